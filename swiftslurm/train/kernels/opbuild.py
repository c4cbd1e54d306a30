"""DeepSpeed's JIT-built ops, built before training under a lock whose holder can be checked.

DeepSpeed compiles some ops on first use through torch's ``cpp_extension``: the CPU comm op inside
``deepspeed.initialize`` on CPU ranks, ``cpu_adam`` with optimizer offload, ``async_io`` with NVMe offload. torch
guards each op's build directory with a bare ``lock`` file (its ``FileBaton``): made when a build starts, removed
when it ends, naming nobody, and every process that loads the op after a build started waits for it to go, with no
limit, at 0% CPU. A rank killed mid-build (walltime, ``scancel``, the OOM killer, an in-job restart) leaves it
behind, and every later job of the user that loads that op waits until its walltime.

So every rank builds (or loads) the ops its run will need before training, one builder at a time per cache: an
``fcntl.flock`` on ``BUILD_LOCK``, which the kernel releases when its holder dies however it dies. The holder writes
who it is into that file (``Holder``: host, pid, time, ops) for as long as it builds and empties it when done, so a
rank that takes the lock and finds a holder written there knows that holder died mid-build, and a torch ``lock`` in
one of its op directories is that dead build's: it is removed and the op is built again (ninja rebuilds the outputs
the dead build left half-written: an output missing from its build log is out of date). A torch ``lock`` that no
dead holder of ours explains is left alone and named: the start-up watchdog (``train/health/startup.py``) ends the
rank with it as the diagnosis if the wait outlasts the start-up limit.

Where: ``$TORCH_EXTENSIONS_DIR`` when the user sets it, else a per-node cache of ours (``default_cache``), per node
so that its lock stays host-local on a home shared over NFS; nobody but our builders builds there, so a torch
``lock`` found there while we hold the build lock is always a dead build's.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ...fsutil import process_start

BUILD_LOCK = ".swiftslurm-build.lock"  # our flock; its body: the Holder building now (or one that died building)
TORCH_LOCK = "lock"  # torch's FileBaton, in each op's build directory
EXTENSIONS_ENV = "TORCH_EXTENSIONS_DIR"
WAIT_POLL_S = 0.5
WAIT_QUIET_S = 10.0  # a wait for a live builder is logged once it took this long,
WAIT_LOG_S = 60.0  # then this often
HOLDER_CAP = 4096

log = logging.getLogger("swiftslurm.train")


@dataclass(frozen=True)
class Holder:
    """Who holds (or held, when it died building) the build lock of a cache."""

    host: str
    pid: int
    since: float  # epoch seconds
    ops: tuple[str, ...]
    machine: str = ""  # the kernel's boot id: node names that alias one machine (a test cluster) are one machine
    pid_start: int = 0  # the process's start time (clock ticks since boot): a reused pid is not the holder

    def line(self) -> str:
        return f"pid {self.pid} on {self.host} (building {', '.join(self.ops) or '?'} since {time.strftime('%H:%M:%S', time.localtime(self.since))})"

    @classmethod
    def parse(cls, raw: bytes) -> Holder | None:
        """The holder written in ``raw`` (the lock file's body); None for an empty or foreign body (pure)."""
        try:
            data = json.loads(raw.decode("utf-8")) if raw.strip() else None
            if not isinstance(data, dict):
                return None
            return cls(str(data["host"]), int(data["pid"]), float(data["since"]), tuple(str(op) for op in data["ops"]),
                       str(data.get("machine", "")), int(data.get("pid_start", 0)))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return None


def default_cache(cache_home: str, host: str, python: str, torch_version: str, prefix: str) -> str:
    """Our per-node op cache (pure): ``<cache_home>/swiftslurm/torch_extensions/<host>/py<ver>-torch<ver>-<env>``; the
    environment's key keeps two venvs (two checkouts) from rebuilding the op in turn on every switch."""
    key = hashlib.sha256(prefix.encode()).hexdigest()[:8]
    leaf = "".join(c if c.isalnum() or c in "._+-" else "_" for c in f"py{python}-torch{torch_version}-{key}")
    host_part = "".join(c if c.isalnum() or c in "._-" else "_" for c in host).lstrip(".") or "host"
    return str(Path(cache_home, "swiftslurm", "torch_extensions", host_part, leaf))


def cache_dir(environ: Mapping[str, str], host: str) -> tuple[str, bool]:
    """(the op cache this rank builds in, whether it is ours); the user's ``$TORCH_EXTENSIONS_DIR`` wins, else ours
    under ``$XDG_CACHE_HOME`` (``~/.cache``), where torch's own cache would be."""
    chosen = environ.get(EXTENSIONS_ENV, "")
    if chosen:
        return chosen, False
    import torch

    cache_home = environ.get("XDG_CACHE_HOME", "") or str(Path(environ.get("HOME", "") or Path.home(), ".cache"))
    python = f"{sys.version_info[0]}{sys.version_info[1]}"
    return default_cache(cache_home, host, python, torch.__version__, sys.prefix), True


def needed_ops(ds_config: Mapping[str, Any], cuda: bool) -> tuple[str, ...]:
    """The DeepSpeed op builders this run loads (pure): the CPU comm op on CPU ranks (at ``deepspeed.initialize``),
    ``cpu_adam`` when the optimizer is offloaded on GPUs (the trainer's DeepSpeedCPUAdam), ``async_io`` for NVMe."""
    zero = ds_config.get("zero_optimization") or {}
    devices = {(zero.get(key) or {}).get("device") for key in ("offload_optimizer", "offload_param")}
    ops: list[str] = [] if cuda else ["ShareMemCommBuilder"]
    if cuda and (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme"):
        ops.append("CPUAdamBuilder")
    if "nvme" in devices:
        ops.append("AsyncIOBuilder")
    return tuple(ops)


def stale_locks(root: Path, ops: tuple[str, ...], previous: Holder | None, ours: bool, host: str) -> tuple[list[Path], list[str]]:
    """Held by us (the build lock), which torch locks of ``ops`` under ``root`` a dead build left (to remove), and
    the ones left for a person to judge (one line each): in our own cache every one is a dead build's; in the user's,
    those that a holder of ours on this machine, dead now, was building."""
    remove: list[Path] = []
    judge: list[str] = []
    for op in ops:
        lock = root / _op_dir_name(op) / TORCH_LOCK
        if not os.path.lexists(lock):
            continue
        if ours or (previous is not None and _here(previous, host) and not _alive(previous)):
            remove.append(lock)
        else:
            who = f"; the last build of ours there was by {previous.line()}" if previous else ""
            judge.append(f"{lock} (torch's build lock, left by a build that is not one of ours{who}): "
                         "if no build of this op is running, delete it")
    return remove, judge


def _op_dir_name(op: str) -> str:
    """The directory torch builds ``op`` in: the builder's NAME (``deepspeed_shm_comm``, ``cpu_adam``, ``async_io``)."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(op)
    return builder.name if builder is not None else op


def this_machine() -> str:
    """The running kernel's boot id ("" where /proc does not have it)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _here(holder: Holder, host: str) -> bool:
    """Whether ``holder`` ran on this machine, where its pid can be checked."""
    mine = this_machine()
    return holder.machine == mine if holder.machine and mine else holder.host == host


def _alive(holder: Holder) -> bool:
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except OSError as exc:
        if exc.errno != errno.EPERM:
            return True
    return not holder.pid_start or process_start(holder.pid) == holder.pid_start


def _open_lock(root: Path) -> int:
    """Our build lock file: made new, or our own regular file (never followed through a link)."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(root / BUILD_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    import stat

    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{root / BUILD_LOCK} is not a regular file")
    return fd


def _read_holder(fd: int) -> Holder | None:
    return Holder.parse(os.pread(fd, HOLDER_CAP, 0))


def _write_holder(fd: int, holder: Holder | None) -> None:
    os.ftruncate(fd, 0)
    if holder is not None:
        os.pwrite(fd, json.dumps({**asdict(holder), "ops": list(holder.ops)}).encode(), 0)
    os.fsync(fd)


def _take(fd: int, lock_path: Path, note: Callable[[str], None]) -> None:
    """Wait for the build lock, saying who holds it (a live builder: the start-up limit bounds the wait)."""
    waited_from = time.monotonic()
    said = 0.0
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        holder = _read_holder(fd)
        what = f"waiting for the op build lock {lock_path}, held by {holder.line() if holder else 'another process'}"
        note(what)
        waited = time.monotonic() - waited_from
        if waited >= said + (WAIT_LOG_S if said else WAIT_QUIET_S):  # another rank's load of a built op takes a second
            log.warning("%s (%.0f s so far)", what, waited)
            said = waited
        time.sleep(WAIT_POLL_S)


def ensure_built(ops: tuple[str, ...], root: str, ours: bool, host: str, note: Callable[[str], None] = lambda _: None) -> None:
    """Build (or load) ``ops`` in ``root`` under the build lock, taking over what a dead build left; a build that fails
    is logged and left to DeepSpeed (which falls back or fails with its own message), never retried here."""
    if not ops:
        return
    if os.environ.get(EXTENSIONS_ENV) != root:  # torch builds where this says: the lock must guard that directory
        raise ValueError(f"{EXTENSIONS_ENV} must be {root!r} in this process's environment before its ops are built")
    path = Path(root)
    try:
        fd = _open_lock(path)
    except OSError as exc:  # a read-only home, a file in the way: DeepSpeed loads (or fails to build) the ops itself
        log.warning("cannot use the op cache %s (%s): DeepSpeed's ops are left to DeepSpeed, without the build lock", path,
                    exc.strerror or exc)
        return
    try:
        note(f"taking the op build lock {path / BUILD_LOCK}")
        _take(fd, path / BUILD_LOCK, note)
        previous = _read_holder(fd)
        remove, judge = stale_locks(path, ops, previous, ours, host)
        for lock in remove:
            log.warning("removing %s: torch's build lock, left by a build that died (%s); building the op again",
                        lock, previous.line() if previous else "its builder holds no lock")
            lock.unlink(missing_ok=True)
        for line in judge:
            log.warning("%s", line)
            note(f"waiting on {line}")
        _write_holder(fd, Holder(host, os.getpid(), time.time(), ops, this_machine(), process_start(os.getpid()) or 0))
        for op in ops:
            if not judge:
                note(f"building DeepSpeed's {op} in {path}")
            _load(op)
        _write_holder(fd, None)
    finally:
        os.close(fd)  # releases the flock


def _load(op: str) -> None:
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(op)
    if builder is None or not builder.is_compatible(verbose=False):
        return
    started = time.monotonic()
    try:
        builder.load(verbose=False)
    except Exception as exc:  # DeepSpeed reports its own failure where it loads the op again
        log.warning("DeepSpeed's %s did not build (%s): left to DeepSpeed", op, str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        return
    took = time.monotonic() - started
    if took > 5:
        log.warning("built DeepSpeed's %s in %.0f s", op, took)
