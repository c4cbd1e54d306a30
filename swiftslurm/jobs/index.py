"""Every job this user submitted, and where it wrote: ``$XDG_STATE_HOME/swiftslurm/jobs.jsonl``
(``~/.local/state/swiftslurm/jobs.jsonl``), one line a submission.

slurmctld forgets a job ``MinJobAge`` after its end (300 s by default), and with it the paths ``doctor JOBID``
and ``status JOBID`` found the job's output dir through; on a cluster without accounting ``sacct`` never knew
them. So ``submit`` also appends the job ids, the job's name, its output dir and the time here, and a command
given a JOBID that Slurm no longer leads to an output dir looks here. The index only says where to look: the job
id must also be in that dir's own submission record (``record.py``), which is what is then read.

Read as data, like every file we did not just write: a regular file only (a link or a FIFO refused, never
followed or blocked on), its newest ``READ_CAP`` bytes, a line that is not one of ours skipped. Kept short:
past ``KEEP_BYTES`` the next ``remember`` rewrites it with its newer half.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path

from ..fsutil import MIB, Unreadable, atomic_write_bytes, loads_json, open_append, read_tail

INDEX_NAME = "jobs.jsonl"
KEEP_BYTES = 2 * MIB  # about 10,000 submissions
READ_CAP = 4 * MIB


def index_path(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    state = env.get("XDG_STATE_HOME", "") or str(Path(env.get("HOME", "") or Path.home(), ".local", "state"))
    return Path(state, "swiftslurm", INDEX_NAME)


def remember(job_ids: list[str], name: str, output_dir: str, path: Path | None = None, when: float | None = None) -> None:
    """Append one submission's line; a failure to write is not the submission's failure (the caller warns)."""
    path = path or index_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    line = json.dumps({"job_ids": [j for j in job_ids if j], "name": name, "output_dir": str(Path(output_dir).resolve()),
                       "time": time.time() if when is None else when}) + "\n"
    with open_append(path) as fh:
        size = os.fstat(fh.fileno()).st_size
        fh.write(line.encode())
    if size + len(line) > KEEP_BYTES:
        _shorten(path)


def _shorten(path: Path) -> None:
    data, _ = read_tail(path, 0, KEEP_BYTES // 2)
    atomic_write_bytes(path, data[data.find(b"\n") + 1:])  # from the first whole line


def output_dirs_of(job_id: str, path: Path | None = None) -> list[str]:
    """The output dirs the index records for ``job_id`` (``123`` or ``123_4``: its array ``123``), newest first."""
    base = job_id.split("_")[0]
    try:
        data, _ = read_tail(path or index_path(), 0, READ_CAP)
    except (FileNotFoundError, Unreadable):
        return []
    found: list[str] = []
    for raw in reversed(data.splitlines()):
        try:
            entry = loads_json(raw)
        except ValueError:
            continue
        if not isinstance(entry, dict):
            continue
        ids, where = entry.get("job_ids"), entry.get("output_dir")
        if (isinstance(ids, list) and isinstance(where, str) and where.startswith("/") and "\0" not in where
                and any(isinstance(j, str) and j.split("_")[0] == base for j in ids) and where not in found):
            found.append(where)
    return found
