"""One live job per task dir: every rank holds a lock in the task's output dir while it runs.

Rank ``r`` takes an exclusive POSIX lock (``fcntl.lockf``, which NFS's lock manager honours) on byte
``r`` of ``<task dir>/.swiftslurm.lock`` and keeps it until its process exits (a requeue is a new
process, so the rerun takes it again). A rank of a second job on the same dir finds its byte taken
and stops before writing anything, naming the job that holds the dir (``.swiftslurm-owner.json``,
written by rank 0). ``holder(dir)`` asks the same question without taking anything, for ``submit``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import struct
import time
from pathlib import Path
from typing import Any, Iterator

from ..errors import RuntimeEnvError
from ..fsutil import RECORD_CAP, atomic_write_text, read_json
from ..taskdir import LOCK_FILE, OWNER_FILE

# An earlier run of the same job (a requeue, or the step before an in-job restart) may still be exiting on another
# node: wait this long for it. Its byte locks go when its processes exit; on a node that crashed they go only when the
# file server gives up on that client: the NFSv4 lease (90 s on Linux's nfsd by default, /proc/fs/nfsd/nfsv4leasetime
# on the server) and its grace. So the wait is that lease and a minute beyond it, not a minute alone (with which a spare
# replacing a crashed node failed "an earlier run of this job still holds its output dir"). NFSv3's NLM locks of a
# client that never comes back are released by no timeout at all: the message then says so.
NFS_LEASE_S = 90.0
SAME_JOB_WAIT_S = NFS_LEASE_S + 60.0

_held: dict[str, int] = {}  # lock path -> fd, for this process's life (closing any fd would drop the lock)


def _owner(out_dir: str | Path) -> dict[str, Any]:
    try:
        data = read_json(Path(out_dir, OWNER_FILE), RECORD_CAP)
    except (OSError, ValueError):  # missing, or Unreadable: no owner record
        return {}
    return {k: v for k, v in data.items() if isinstance(v, (str, int, float)) and not isinstance(v, bool)}


def describe(owner: dict[str, Any]) -> str:
    if not owner:
        return "a job whose owner record is missing"
    return f"job {owner.get('job_id', '?')} (rank 0 pid {owner.get('pid', '?')} on {owner.get('node', '?')}, since {owner.get('since', '?')})"


def claim(out_dir: str, rank: int, job_id: str, node: str = "") -> None:
    """Lock byte ``rank`` of the task dir's lock file for this process's life, or raise RuntimeEnvError."""
    path = Path(out_dir, LOCK_FILE)
    if str(path) in _held:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + SAME_JOB_WAIT_S
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, rank)
            break
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                os.close(fd)
                raise
            owner = _owner(out_dir)
            if owner.get("job_id") == job_id and time.monotonic() < deadline:
                time.sleep(0.5)  # our own job's earlier run is still exiting
                continue
            os.close(fd)
            if owner.get("job_id") == job_id:  # an earlier step or run of this same job, its processes still exiting
                raise RuntimeEnvError(
                    "an earlier run of this job still holds its output dir",
                    f"{out_dir} is held by {describe(owner)}: its processes did not exit within {SAME_JOB_WAIT_S:g} s; "
                    f"this is rank {rank}",
                    "a process of the earlier step is stuck (see `swiftslurm doctor` and Slurm's UnkillableStepTimeout), or "
                    "its node crashed and the shared filesystem still holds its locks (an NFSv3 server keeps them until that "
                    "node is back); cancel the job and resubmit: it resumes from the newest verified checkpoint",
                ) from None
            raise RuntimeEnvError(
                "another job is running in this output dir",
                f"{out_dir} is held by {describe(owner)}; this is job {job_id}, rank {rank}",
                f"stop the other job (`swiftslurm cancel {out_dir}`) or give this one another job.output_dir",
            ) from None
    _held[str(path)] = fd
    if rank == 0:
        since = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        atomic_write_text(Path(out_dir, OWNER_FILE), json.dumps({"job_id": job_id, "node": node or socket.gethostname(), "pid": os.getpid(), "since": since}))


def holder(out_dir: str | Path) -> dict[str, Any] | None:
    """The owner record when a live process holds rank 0's byte of ``out_dir``'s lock, else None.

    Asks with F_GETLK: takes no lock and writes nothing.
    """
    try:  # O_NONBLOCK: a FIFO planted under the lock's name must not block the open
        fd = os.open(Path(out_dir, LOCK_FILE), os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # not a lock file we made: nobody holds it
            return None
        query = struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, query)
    except OSError:
        return None
    finally:
        os.close(fd)
    l_type, _, _, _, pid = struct.unpack("hhqqi", answer)
    if l_type == fcntl.F_UNLCK:
        return None
    return _owner(out_dir) or {"pid": pid}


# ---------------------------------------------------------------- writers that are not ranks of a job


class DirInUse(RuntimeEnvError):
    """A dir a live job owns (its lock, or the lock of a dir above it, is held): exit 3, nothing written."""

    exit_code = 3


def _lock_holder_pid(path: Path) -> int | None:
    """The pid of another process holding any byte of the lock file ``path`` (F_GETLK: takes nothing), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        answer = fcntl.fcntl(fd, fcntl.F_GETLK, struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
    except OSError:
        return None
    finally:
        os.close(fd)
    l_type, _, _, _, pid = struct.unpack("hhqqi", answer)
    return None if l_type == fcntl.F_UNLCK else pid


def _refuse(out_dir: Path, held: Path, pid: int | None, who: str) -> DirInUse:
    where = f"{held}" if held == out_dir else f"{held}, a dir above {out_dir},"
    return DirInUse(f"{who} refused: another job owns this output dir",
                    f"{where} is held by {describe(_owner(held))}" + (f" (lock held by pid {pid})" if pid else ""),
                    "wait for that job to end or stop it (`swiftslurm cancel DIR`), or choose another dir; nothing was written")


def refuse_if_held(out_dir: str | Path, who: str) -> Path:
    """DirInUse when a live process holds any byte of ``out_dir``'s lock, or rank 0's of a dir above it; reads
    only (F_GETLK). Returns ``out_dir`` made absolute."""
    out = Path(out_dir).absolute()
    for above in out.parents:
        if holder(above) is not None:
            raise _refuse(out, above, _lock_holder_pid(above / LOCK_FILE), who)
    pid = _lock_holder_pid(out / LOCK_FILE)
    if pid is not None:
        raise _refuse(out, out, pid, who)
    return out


@contextlib.contextmanager
def outside_writer(out_dir: str | Path, who: str) -> Iterator[Path]:
    """Hold ``out_dir`` for a writer that is not a rank of a job (``swiftslurm import``), for the ``with`` block.

    Refuses (DirInUse, exit 3) before writing anything when a live process holds any byte of its lock (a rank
    of another job) or rank 0's byte of a dir above it (a job whose output dir holds this one). Else it takes
    every byte of the lock, so no rank of a job starts in the dir meanwhile (its claim fails and names the
    dir's owner), and lets go when the block ends. Never call it in a process that claimed ``out_dir`` as a
    rank: closing the lock file drops that claim too.
    """
    out = refuse_if_held(out_dir, who)
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 0, 0)  # length 0: every byte, every rank's included
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            raise _refuse(out, out, _lock_holder_pid(out / LOCK_FILE), who) from None
        yield out
    finally:
        os.close(fd)
