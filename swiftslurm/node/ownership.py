"""One live job per task dir: every rank holds a lock in the task's output dir while it runs.

Rank ``r`` takes an exclusive POSIX lock (``fcntl.lockf``, which NFS's lock manager honours) on byte
``r`` of ``<task dir>/.swiftslurm.lock`` and keeps it until its process exits (a requeue is a new
process, so the rerun takes it again). A rank of a second job on the same dir finds its byte taken
and stops before writing anything, naming the job that holds the dir (``.swiftslurm-owner.json``,
written by rank 0). ``holder(dir)`` asks the same question without taking anything, for ``submit``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import struct
import time
from pathlib import Path
from typing import Any

from ..errors import RuntimeEnvError
from ..fsutil import RECORD_CAP, atomic_write_text, read_json

LOCK_FILE = ".swiftslurm.lock"
OWNER_FILE = ".swiftslurm-owner.json"
# An earlier run of the same job (a requeue) may still be exiting on another node: wait this long for it.
SAME_JOB_WAIT_S = 60.0

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
