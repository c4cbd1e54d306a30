"""The singleton chain: where ``scontrol requeue`` is not allowed, a walltime stop continues as a new job.

With ``slurm.continue_with = "singleton"`` rank 0 of a job stopped at walltime submits the same work again before
it exits: ``sbatch --dependency=singleton`` of the same batch script (same job name, so Slurm starts the new job only
once this one has ended), and rank 0 then exits. The same work is:

- a job submitit sent: its batch script ``<folder>/<job>_submission.sh`` (an array task: the array's script with
  ``--array=<task>``), and the pickled callable of this job, copied byte for byte to the name the new job id gives it
  (``<folder>/<new job>_submitted.pkl``; never unpickled here). The singleton dependency holds the new job until
  this one has ended, so the copy is in place before it can start;
- a rendered script sent with plain ``sbatch``: the script Slurm recorded for this job (``scontrol show job``'s
  ``Command``).

Every link is recorded in ``<task dir>/chain.json`` (``{"chains": [{"name": ..., "links": [job ids]}]}``) so that
``status`` of the output dir follows a chain to its newest link, and the bound holds: ``slurm.max_requeues`` counts
chain links and requeues together (``continuations``). The new job inherits this rank's environment without
Slurm's and the rank's own variables (``submit_env``): the batch script sets what the job needs.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..records.chains import links_before, newest, read_chains, with_link, write_chains  # noqa: F401  (the chain's record)
from ..spec.model import PER_RANK_VARS, RUNTIME_VARS
from ..train.health.watchdog import ATTEMPT_ENV, HANG_RESTART_ENV
from .restart import PROBE_MASTER_ENV, STEP_NODES_ENV

# what a rank's environment holds that belongs to this job, this step or this rank, never to the next job
JOB_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SUBMITIT_", "TORCHELASTIC_", "PMI_", "PMIX_", "OMPI_")
JOB_VARS = (*PER_RANK_VARS, *RUNTIME_VARS, "MASTER_ADDR", "MASTER_PORT")
# ... and what the in-job restart supervisor set for this step: a shrunk node count left in the next link's environment
# made its ranks fail their allocation check (the next link starts on the spec's own nodes, at attempt 0)
SUPERVISOR_VARS = (STEP_NODES_ENV, ATTEMPT_ENV, HANG_RESTART_ENV, PROBE_MASTER_ENV)


def submit_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment the next link is submitted with (pure): this rank's, without this job's Slurm, submitit,
    launcher and rank variables (a stale SLURM_RESTART_COUNT or SLURM_ARRAY_TASK_ID would mislead the next job)."""
    return {k: v for k, v in environ.items() if not k.startswith(JOB_PREFIXES) and k not in JOB_VARS and k not in SUPERVISOR_VARS}


# ---------------------------------------------------------------- how this job was sent


@dataclass(frozen=True)
class Resubmit:
    """What sbatch gets to send the same work again: the script, its extra options, and (submitit) the pickle."""

    script: str
    extra: tuple[str, ...] = ()
    pickle: str = ""  # submitit: this job's ``_submitted.pkl``, copied for the new job id
    folder: str = ""


def how_to_resubmit(requeue_id: str, environ: Mapping[str, str], batch_script) -> Resubmit:
    """The same work as this job (``requeue_id``: ``123`` or ``123_4``). ``batch_script(job_id)`` asks Slurm for the
    script of a job sent with plain sbatch. ValueError saying why when neither way is there."""
    base, _, task = requeue_id.partition("_")
    array = (f"--array={task}",) if task else ()
    folder = environ.get("SUBMITIT_FOLDER", "")
    if folder:
        script = Path(folder, f"{base}_submission.sh")
        pickle = Path(folder, f"{requeue_id}_submitted.pkl")
        if not (script.is_file() and pickle.is_file()):
            raise ValueError(f"submitit's files of job {requeue_id} are not in {folder} ({script.name}, {pickle.name})")
        return Resubmit(str(script), array, str(pickle), folder)
    script_path = batch_script(requeue_id)
    if not script_path or not Path(script_path).is_file():
        raise ValueError(f"Slurm names no batch script for job {requeue_id} that this node can read ({script_path or 'none'})")
    return Resubmit(script_path, array)


def continue_job(requeue_id: str, job_name: str, task_dir: str, environ: Mapping[str, str], cwd: str) -> str:
    """Submit the next link of this job's chain (singleton: it starts once this job has ended) and record it.
    Returns the new job id (``130`` or ``130_4``). SwiftSlurmError when Slurm refuses, ValueError when the work
    cannot be found."""
    from .. import slurm

    how = how_to_resubmit(requeue_id, environ, slurm.batch_script)
    extra = ["--dependency=singleton", f"--job-name={job_name}", f"--chdir={cwd}", *how.extra]
    new = slurm.sbatch(how.script, extra, env=submit_env(environ))
    task = requeue_id.partition("_")[2]
    new_id = f"{new}_{task}" if task else new
    if how.pickle:  # submitit reads the callable under the new id; the dependency holds the job until we exit
        target = Path(how.folder, f"{new_id}_submitted.pkl")
        tmp = target.with_name(f".{target.name}.tmp.{os.getpid()}")
        shutil.copyfile(how.pickle, tmp)
        os.replace(tmp, target)
    write_chains(task_dir, with_link(read_chains(task_dir), requeue_id, new_id), job_name)
    return new_id


def record_entry(entry: dict[str, Any], new_id: str) -> dict[str, Any]:
    """The requeues.json record of a stop continued as ``new_id``."""
    return {**entry, "requeued": True, "outcome": "chained", "next_job": new_id,
            "message": f"walltime stop: continued as job {new_id} (--dependency=singleton)", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
