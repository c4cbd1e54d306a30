"""W&B and MLflow themselves, on rank 0: open a run (continued by id, else new), log one step, close.

Both log at the Trainer's global step (W&B ``step=``, MLflow's metric step), so the step axis of a run continued
after a requeue goes on where it stopped; in W&B offline mode each start writes its own ``offline-run-*`` dir under
the same run id, and ``wandb sync`` uploads them in order into one run. A failed log call is said once and training
goes on (a tracker that blips must not end a three-day run); a run that cannot be opened stops the start, with why.
"""

from __future__ import annotations

import logging
import secrets
import string
import time
from typing import TYPE_CHECKING, Any, Callable

from .identity import PARAM_VALUE_MAX, RunIdentity, TrackerUnavailable, metric_name

if TYPE_CHECKING:
    from collections.abc import Mapping

log = logging.getLogger("swiftslurm.train")

FINISHED, PAUSED, FAILED = "finished", "paused", "failed"  # how a start ends: done, stopped to continue, an error
MLFLOW_STATUS = {FINISHED: "FINISHED", PAUSED: "SCHEDULED", FAILED: "FAILED"}  # SCHEDULED: it continues on a requeue
PARAMS_PER_CALL = 100  # MLflow's limit of params in one log_batch


def new_wandb_id() -> str:
    """Eight of [a-z0-9], the shape W&B gives its own ids."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


class _Sink:
    name = ""

    def __init__(self) -> None:
        self.failed_logs = 0

    def log(self, step: int, values: Mapping[str, float]) -> None:
        try:
            self._log(step, values)
        except Exception as exc:  # noqa: BLE001 -- any library or network error: said once, training goes on
            self.failed_logs += 1
            if self.failed_logs == 1:
                log.warning("trackers: %s could not log step %d (%s: %s); training goes on, later steps are tried",
                            self.name, step, type(exc).__name__, str(exc)[:200])

    def _log(self, step: int, values: Mapping[str, float]) -> None:
        raise NotImplementedError

    def close(self, how: str) -> None:
        raise NotImplementedError


class WandbSink(_Sink):
    name = "wandb"

    def __init__(self, run: Any) -> None:
        super().__init__()
        self.run = run

    @classmethod
    def open(cls, run_id: str, ident: RunIdentity, config: dict[str, Any], run_dir: str) -> WandbSink:
        """``wandb.init`` with the kept id and ``resume="allow"`` (continued if it exists, else created under that id);
        mode, entity and key come from the environment (``WANDB_MODE=offline`` on nodes without internet)."""
        import wandb

        try:
            run = wandb.init(id=run_id, resume="allow", project=ident.project, name=ident.name, group=ident.group,
                             dir=run_dir, settings=wandb.Settings(console="off", quiet=True))  # our logs stay ours
            run.config.update(config, allow_val_change=True)
        except Exception as exc:  # noqa: BLE001 -- no key, no network, a refused id: the message says which
            raise TrackerUnavailable(
                "cannot start the W&B run (train.report_to = \"wandb\")", f"{type(exc).__name__}: {str(exc)[:300]}",
                "on nodes without internet set WANDB_MODE = \"offline\" in [env] and `wandb sync` afterwards; online, "
                "set WANDB_API_KEY in [env] (or `wandb login` on a shared home)") from None
        return cls(run)

    def _log(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log({metric_name(k, "wandb"): v for k, v in values.items()}, step=step)

    def close(self, how: str) -> None:
        self.run.finish(exit_code=1 if how == FAILED else 0)


class MlflowSink(_Sink):
    name = "mlflow"

    def __init__(self, client: Any, run_id: str) -> None:
        super().__init__()
        self.client = client
        self.run_id = run_id

    @classmethod
    def open(cls, run_id: str | None, ident: RunIdentity, config: dict[str, Any], tracking_uri: str,
             parent: Callable[[Any, str], str | None]) -> MlflowSink:
        """The kept run, set RUNNING again; or (none kept, or gone from this store) a new run with the config as its
        params, nested under the sweep's parent run (``parent(client, experiment_id)``) in a sweep."""
        try:
            from mlflow import MlflowClient

            client = MlflowClient(tracking_uri)
            if run_id is not None and _live(client, run_id):
                client.update_run(run_id, status="RUNNING")
                return cls(client, run_id)
            if run_id is not None:
                log.warning("trackers: MLflow run %s is not in %s (deleted, or another store); starting a new run",
                            run_id, tracking_uri)
            experiment = experiment_id(client, ident.experiment)
            tags = {"swiftslurm.job": ident.name.split("/")[0]}
            if ident.task is not None:
                tags["swiftslurm.task"] = str(ident.task)
            parent_id = parent(client, experiment) if ident.group else None
            if parent_id:
                tags["mlflow.parentRunId"] = parent_id
            run = client.create_run(experiment, run_name=ident.name, tags=tags)
            log_params(client, run.info.run_id, config)
        except Exception as exc:  # noqa: BLE001 -- a store we cannot write, a server we cannot reach
            raise TrackerUnavailable(
                "cannot open the MLflow run (train.report_to = \"mlflow\")", f"{tracking_uri}: {type(exc).__name__}: {str(exc)[:300]}",
                "leave MLFLOW_TRACKING_URI unset for a file store under job.output_dir (no server needed), or set it in "
                "[env] to a server every node can reach") from None
        return cls(client, run.info.run_id)

    def _log(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(metric_name(k, "mlflow"), v, now, step) for k, v in values.items()])

    def close(self, how: str) -> None:
        self.client.set_terminated(self.run_id, status=MLFLOW_STATUS[how])


def _live(client: Any, run_id: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id).info.lifecycle_stage != "deleted"
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return False
        raise


def experiment_id(client: Any, name: str) -> str:
    """The experiment called ``name``, created when missing (another task may create it at the same moment)."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id


def parent_run(client: Any, experiment: str, group: str, kept: str | None) -> str:
    """A sweep's parent run: the kept one if it is still there, else a new one named after the sweep (FINISHED at
    once: it only holds its tasks' runs). The caller holds the sweep lock and keeps the id."""
    if kept is not None and _live(client, kept):
        return kept
    run = client.create_run(experiment, run_name=group, tags={"swiftslurm.sweep": group})
    client.set_terminated(run.info.run_id, status="FINISHED")
    return run.info.run_id


def log_params(client: Any, run_id: str, config: dict[str, Any]) -> None:
    from mlflow.entities import Param

    params = [Param(k, str(v)[:PARAM_VALUE_MAX]) for k, v in config.items()]
    for i in range(0, len(params), PARAMS_PER_CALL):
        client.log_batch(run_id, params=params[i:i + PARAMS_PER_CALL])
