"""Who a tracker run is, pure: which trackers a spec asks for, the run's name and group, where the runs go by
default, the config it records, and whether a start continues the run the task dir names.

Nothing here imports wandb or mlflow: ``validate`` on the login side asks ``missing_packages`` (find_spec).
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ...errors import Problem, RuntimeEnvError
from ...taskdir import MLFLOW_STORE_DIR

if TYPE_CHECKING:
    from ...spec.model import JobSpec

INSTALL_HINT = "pip install 'swiftslurm[tracking]' (wandb, mlflow-skinny)"
TRACKERS = ("wandb", "mlflow")  # the report_to values this package serves (tensorboard stays the Trainer's)
# closing the trackers at a walltime stop, all of them together: within the deadline's reserve (health/deadline.py),
# so an online flush never pushes the requeue past the time limit (their steps are logged already)
PAUSE_CLOSE_S = 5.0
PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}  # the import name each needs (`pip install 'swiftslurm[tracking]'`)
RUN_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # W&B: 8 of [a-z0-9]; MLflow: 32 hex digits
PARAM_VALUE_MAX = 500  # characters of one recorded config value (MLflow keeps 6000; a dataset list can be long)


@dataclass(frozen=True)
class RunIdentity:
    """The names a task's tracker run carries, the same on every start of its training."""

    name: str  # "<job name>", or "<job name>/<task>" in a sweep
    group: str | None  # a sweep's tasks share it (W&B group, MLflow parent run name): the job name; None without a sweep
    project: str  # W&B project and MLflow experiment: WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME, else the job name
    experiment: str
    task: int | None  # the sweep task index


def wanted(spec: JobSpec) -> tuple[str, ...]:
    """The trackers of ``train.report_to`` this package runs, in report_to's order."""
    return tuple(r for r in spec.train.report_to if r in TRACKERS)


def missing_packages(trackers: tuple[str, ...] | list[str]) -> list[str]:
    """The trackers whose library is not importable here (find_spec: nothing is imported)."""
    return [t for t in trackers if importlib.util.find_spec(PACKAGES[t]) is None]


class TrackerUnavailable(RuntimeEnvError):
    """A tracker the spec asks for cannot run: its library is missing, or rank 0 could not open its run."""


def check_installed(spec: JobSpec) -> None:
    """On the node, before training: every tracker of report_to can be imported (else TrackerUnavailable)."""
    missing = missing_packages(wanted(spec))
    if missing:
        raise TrackerUnavailable(*_missing_text(missing), f"{INSTALL_HINT} in the job's environment, or drop it from report_to")


def login_problem(spec: JobSpec, same_interpreter: bool) -> Problem | None:
    """``validate`` on the login side: the ranks run this very interpreter (no container, no other slurm.python), so
    a tracker library missing here is missing on the nodes too. Elsewhere only the node can tell."""
    missing = missing_packages(wanted(spec)) if same_interpreter else []
    if not missing:
        return None
    what, found = _missing_text(missing)
    return Problem("train.report_to", what, found, f"{INSTALL_HINT}, or drop it from report_to")


def _missing_text(missing: list[str]) -> tuple[str, str]:
    return (f"report_to names {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not installed",
            ", ".join(PACKAGES[t] for t in missing) + " not importable")


def job_dir(task_dir: str | Path, task: int | None) -> Path:
    """``job.output_dir`` as the plan resolved it: a sweep's task dirs are ``<job.output_dir>/<index>`` (plan.py)."""
    return Path(task_dir).parent if task is not None else Path(task_dir)


def identity(spec: JobSpec, task: int | None, env: Mapping[str, str]) -> RunIdentity:
    """``task``: the sweep task index (``runfile.sweep_task``), None outside a sweep."""
    name = spec.job.name if task is None else f"{spec.job.name}/{task}"
    return RunIdentity(name=name, group=spec.job.name if task is not None else None,
                       project=env.get("WANDB_PROJECT") or spec.job.name,
                       experiment=env.get("MLFLOW_EXPERIMENT_NAME") or spec.job.name, task=task)


def env_defaults(spec: JobSpec, task_dir: str | Path, task: int | None, env: Mapping[str, str]) -> dict[str, str]:
    """What rank 0 exports before a tracker starts, where the user's environment ([env]) says nothing: the MLflow
    store is a file store under ``job.output_dir`` (every task of a sweep in one; no server needed on the nodes),
    which MLflow 3 uses only with ``MLFLOW_ALLOW_FILE_STORE``. W&B's mode, project and key are the user's
    (``WANDB_MODE=offline`` on nodes without internet); its run dirs go to the task dir (``wandb.init(dir=...)``)."""
    out: dict[str, str] = {}
    if "mlflow" in wanted(spec):
        uri = env.get("MLFLOW_TRACKING_URI") or f"file:{job_dir(task_dir, task) / MLFLOW_STORE_DIR}"
        if not env.get("MLFLOW_TRACKING_URI"):
            out["MLFLOW_TRACKING_URI"] = uri
        if is_file_store(uri) and not env.get("MLFLOW_ALLOW_FILE_STORE"):
            out["MLFLOW_ALLOW_FILE_STORE"] = "true"
    return out


def is_file_store(uri: str) -> bool:
    """A local MLflow file store: a ``file:`` URI or a path."""
    return uri.startswith(("file:", "/", "./", "../"))


def continues(run_ids: Mapping[str, Any] | None, resumed_own_checkpoint: bool, job_id: str) -> bool:
    """Whether this start continues the tracker run the task dir names: a resume from its own checkpoint (a requeue,
    a restart, a resubmitted spec) does, and so does any start of the same Slurm job (a requeue or restart before
    the first checkpoint). A fresh start by another job (or from ``train.resume_from``) is a new training: a new run."""
    if not run_ids:
        return False
    return resumed_own_checkpoint or str(run_ids.get("job_id", "")) == job_id


def config(spec: JobSpec, world_size: int, task: int | None) -> dict[str, str | int | float | bool]:
    """What a run records about its training: the [train] and [parallel] keys that are set, the job name, the world
    size and the sweep task; never ``[env]`` (it may hold keys) nor ``train.command``. Flat, scalar values."""
    flat: dict[str, str | int | float | bool] = {"job.name": spec.job.name, "world_size": world_size}
    if task is not None:
        flat["sweep.task"] = task
    train = spec.train.model_dump(mode="json", exclude={"command"}, exclude_none=True)
    for table, values in (("train", train), ("parallel", spec.parallel.model_dump(mode="json", exclude_none=True))):
        for key, value in values.items():
            flat[f"{table}.{key}"] = value if isinstance(value, (str, int, float, bool)) else json.dumps(value)[:PARAM_VALUE_MAX]
    return {k: v[:PARAM_VALUE_MAX] if isinstance(v, str) else v for k, v in flat.items()}


def metric_name(key: str, tracker: str) -> str:
    """W&B: the Trainer's layout (``train/loss``, ``eval/loss``), so its charts group as for any HF run; MLflow: the
    key as logged, with the characters it refuses replaced (as transformers' MLflowCallback does)."""
    if tracker == "wandb":
        for prefix in ("eval", "test"):
            if key.startswith(prefix + "_"):
                return f"{prefix}/{key[len(prefix) + 1:]}"
        return f"train/{key}"
    return re.sub(r"[^0-9A-Za-z_\-. :/]", "_", key)


def scalars(logs: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of one Trainer log call (a bool or a string is no metric)."""
    return {k: float(v) for k, v in logs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def valid_run_id(value: Any) -> str | None:
    return value if isinstance(value, str) and RUN_ID_RE.fullmatch(value) else None
