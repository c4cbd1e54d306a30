"""The export as a one-node Slurm job (``--executor slurm``), for models too big for a login node.

``export_job(request)`` is pure: the sbatch options (an argv list: no value is ever parsed by a shell or by
sbatch's ``#SBATCH`` tokenizer) and the batch script, whose one command is the same export run in the job
(``PYTHON -m swiftslurm export SOURCE --to DIR --executor local ...``, every word through ``shell_quote``).
``submit_export`` writes the script beside ``--to`` and sends it through the one door (``slurm.sbatch``).
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import slurm
from ..fsutil import write_named_file
from ..quoting import shell_quote
from ..spec.model import time_limit_s
from .source import ExportRefused, shard_bytes

JOB_NAME = "swiftslurm-export"
_WORD_RE = re.compile(r"[A-Za-z0-9_.,+-]+")
_MEM_RE = re.compile(r"[0-9]+[KMGT]?")
WAIT_POLL_S = 3.0


@dataclass(frozen=True)
class ExportRequest:
    """What the job exports (absolute paths: the job may start in another working dir) and where it runs."""

    source: str
    to: Path
    task: int | None = None
    adapter_only: bool = False
    dtype: str = "auto"
    max_shard_size: str = "5GB"
    base_model: str | None = None
    partition: str | None = None
    account: str | None = None
    time: str = "02:00:00"
    cpus: int = 8
    mem: str | None = None
    python: str = sys.executable

    def script_path(self) -> Path:
        return self.to.parent / f".{self.to.name}.export.sbatch"

    def log_pattern(self) -> Path:
        return self.to.parent / f"{self.to.name}.export-%j.log"


def _checked(req: ExportRequest) -> None:
    shard_bytes(req.max_shard_size)
    for name, value in (("--partition", req.partition), ("--account", req.account)):
        if value is not None and not _WORD_RE.fullmatch(value):
            raise ExportRefused(f"{name} must be a Slurm name", repr(value), "letters, digits and _ . , + - only")
    if req.mem is not None and not _MEM_RE.fullmatch(req.mem):
        raise ExportRefused("--mem must be what sbatch --mem takes", repr(req.mem), "e.g. 64G or 200000M")
    try:
        time_limit_s(req.time)
    except ValueError:
        raise ExportRefused("--time must be an sbatch time", repr(req.time), "e.g. 02:00:00, 90 (minutes) or 1-00:00:00") from None
    if req.cpus < 1:
        raise ExportRefused("--cpus must be at least 1", str(req.cpus), "e.g. --cpus 8")


def export_argv(req: ExportRequest) -> list[str]:
    """The command the job runs: this export, in the job's own process (pure)."""
    argv = [req.python, "-m", "swiftslurm", "export", req.source, "--to", str(req.to), "--executor", "local",
            "--dtype", req.dtype, "--max-shard-size", req.max_shard_size]
    argv += ["--task", str(req.task)] if req.task is not None else []
    argv += ["--adapter-only"] if req.adapter_only else []
    argv += ["--base-model", req.base_model] if req.base_model else []
    return argv


def export_job(req: ExportRequest) -> tuple[list[str], str]:
    """(the sbatch options, the batch script) of the export job (pure)."""
    _checked(req)
    options = [f"--job-name={JOB_NAME}", "--nodes=1", "--ntasks=1", f"--cpus-per-task={req.cpus}", f"--time={req.time}",
               f"--output={req.log_pattern()}"]
    options += [f"--partition={req.partition}"] if req.partition else []
    options += [f"--account={req.account}"] if req.account else []
    options += [f"--mem={req.mem}"] if req.mem else []
    script = "\n".join([
        "#!/bin/bash",
        f"# swiftslurm export: {req.source} -> {req.to}".replace("\n", " "),
        "set -euo pipefail",
        f"export OMP_NUM_THREADS={req.cpus}",
        "exec " + " ".join(shell_quote(word) for word in export_argv(req)),
        "",
    ])
    return options, script


def submit_export(req: ExportRequest) -> str:
    """Write the script beside ``--to`` and ``sbatch`` it; the job id."""
    options, script = export_job(req)
    req.to.parent.mkdir(parents=True, exist_ok=True)
    write_named_file(req.script_path(), script)  # beside --to: never through a link, nor over another user's file
    return slurm.sbatch(str(req.script_path()), options)


def wait_job(job_id: str, poll_s: float = WAIT_POLL_S, sleep: Callable[[float], None] = time.sleep) -> str:
    """Wait until Slurm says the job ended; its final state."""
    while True:
        record = slurm.job_records([job_id]).get(job_id)
        if record is not None and slurm.is_final(record.state):
            return record.state
        sleep(poll_s)
