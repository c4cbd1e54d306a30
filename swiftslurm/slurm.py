"""The one door to Slurm: every sbatch/squeue/sacct/scontrol/scancel call lives here.

Calls are argv lists (never a shell string). Parsers of their output are pure functions,
tested on captured real output. Nothing else in swiftslurm runs a Slurm command.
"""

from __future__ import annotations

import shutil
import subprocess

from .errors import SwiftSlurmError, ToolMissing

SLURM_TIMEOUT_S = 60


def _run(argv: list[str], timeout_s: float = SLURM_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
    if shutil.which(argv[0]) is None:
        raise ToolMissing(
            f"'{argv[0]}' is not on PATH",
            f"PATH has no {argv[0]}",
            "run on a Slurm login node, or use --executor local",
        )
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SwiftSlurmError(f"'{argv[0]}' did not answer within {timeout_s:.0f} s", " ".join(argv[:3]), "is slurmctld up? try `sinfo`") from None
    if check and proc.returncode != 0:
        raise SwiftSlurmError(f"'{argv[0]}' failed (exit {proc.returncode})", (proc.stderr or proc.stdout).strip()[:500], "see Slurm's message above")
    return proc


def have_slurm() -> bool:
    return shutil.which("sbatch") is not None


def show_hostnames(hostlist: str) -> list[str]:
    """``scontrol show hostnames`` (for cross-checks; swiftslurm itself expands with python-hostlist)."""
    return _run(["scontrol", "show", "hostnames", hostlist]).stdout.split()


def requeue(job_id: str) -> None:
    """``scontrol requeue`` one job or one array task (``123_4``)."""
    _run(["scontrol", "requeue", job_id])
