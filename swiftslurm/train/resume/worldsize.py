"""The trainer's side of resuming on another world size: one rank converts, every rank loads the universal sibling.

Called on every rank after the resume point is agreed (``resume.resolve``) and before the Trainer builds the
DeepSpeed engine. ``checkpoint.formats.universal.plan_load`` (pure, the same on every rank) decides; on "convert",
rank 0 runs DeepSpeed's tool (``checkpoint.formats.universal.convert``, bounded by ``checkpoint.convert_timeout_s``)
while the other ranks wait in a broadcast on a gloo group whose timeout is that bound plus a minute; then every
rank checks it can read the sibling (``checkpoint.agree_resume_point``), and the DeepSpeed config gets
``"checkpoint": {"load_universal": true}``.
"""

from __future__ import annotations

import datetime
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import checkpoint as ck
from ...checkpoint.formats import universal as ucp
from .agree import ProcessGroupExchange

if TYPE_CHECKING:
    from ...slurm.distenv import DistEnv

log = logging.getLogger("swiftslurm.train")
WAIT_MARGIN_S = 60.0  # the other ranks wait this much longer than rank 0's conversion may take


def zero_stage(ds_config: dict[str, Any]) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0) or 0)


class _BoundedExchange(ProcessGroupExchange):
    """The exchange over a gloo group with its own timeout: a rank waiting on rank 0 gives up after ``timeout_s``."""

    def __init__(self, timeout_s: float):
        import torch.distributed as tdist

        self.group = tdist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    def broadcast(self, obj: Any) -> Any:
        import torch.distributed as tdist

        box = [obj]
        tdist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def load_plan(resume_from: str, world_size: int, ds_config: dict[str, Any]) -> ucp.LoadPlan:
    manifest = ck.read_manifest(Path(resume_from))
    return ucp.plan_load(ucp.writer_layout(manifest.meta, manifest.files), ucp.Layout(world_size, zero_stage(ds_config)))


def adapt(resume_from: str | None, output_dir: str, dist: DistEnv, args, algo: str, timeout_s: float) -> str | None:
    """The checkpoint to hand the Trainer: ``resume_from`` itself, or its verified universal sibling (then the
    DeepSpeed config in ``args`` loads it with ``load_universal``). Raises the same error on every rank."""
    if not resume_from or getattr(args, "hf_deepspeed_config", None) is None:
        return resume_from  # nothing to resume, or plain DDP (deepspeed = "none"): HF's own checkpoint, any world size
    plan = load_plan(resume_from, dist.world_size, args.hf_deepspeed_config.config)
    src = Path(resume_from)
    if plan.action == "as_is":
        return resume_from
    what = f"{src.name} was written by {plan.writer.describe()}; this run has {plan.reader.describe()}"
    if plan.action == "refuse":
        raise ucp.CheckpointNotConvertible(f"{what}: cannot resume from it", plan.reason,
                                           ucp.manual_way(src, output_dir, plan.writer))
    import torch.distributed as tdist

    multi = tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1
    exchange = _BoundedExchange(timeout_s + WAIT_MARGIN_S) if multi else ck.SingleRank()
    outcome: dict[str, Any] = {}
    if dist.rank == 0:
        log.warning("swiftslurm: %s: converting it to a universal checkpoint (DeepSpeed ds_to_universal)", what)
        try:
            path, seconds = ucp.convert(src, output_dir, plan, algo=algo, timeout_s=timeout_s, log=log.warning)
            outcome = {"path": str(path), "seconds": seconds}
        except ucp.CheckpointNotConvertible as exc:
            outcome = {"error": [exc.what, exc.found, exc.hint]}
    try:
        outcome = exchange.broadcast(outcome)
    except RuntimeError as exc:  # gloo's timeout (DistBackendError is a RuntimeError), or rank 0 died
        raise ucp.CheckpointNotConvertible(
            f"rank {dist.rank} on {dist.node} waited {timeout_s + WAIT_MARGIN_S:g} s for rank 0 to convert {src.name}",
            str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__,
            "rank 0's log says what happened; raise checkpoint.convert_timeout_s if the conversion is just slow") from None
    if "error" in outcome:
        raise ucp.CheckpointNotConvertible(*outcome["error"])
    sibling = Path(outcome["path"])
    ck.agree_resume_point(output_dir, dist.rank, dist.node, exchange, lambda: sibling, log.warning)
    for config in {id(c): c for c in (args.hf_deepspeed_config.config, args.deepspeed)
                   if isinstance(c, dict)}.values():
        config.setdefault("checkpoint", {})["load_universal"] = True
    if dist.rank == 0:
        log.warning("swiftslurm: resuming at step %d on %s from the universal checkpoint %s (ready in %.1f s; "
                    "RNG states of ranks the writer did not have start from the seed)",
                    ck.read_manifest(sibling).step, plan.reader.describe(), sibling, outcome["seconds"])
    return str(sibling)


def untie_step_counters(optimizer: Any) -> int:
    """Give every optimizer state its own ``step`` tensor; how many were shared. DeepSpeed's ZeRO-3 universal load
    (0.19.8, ``stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3``) puts ONE step tensor into the state of
    every parameter sub-group, and torch's Adam advances ``step`` in place once per sub-group: after the load the
    count ran N times too fast and Adam's bias correction drifted (the 1.2e-2 loss drift within 3 steps once
    documented here). A no-op where nothing is shared."""
    import torch

    inner = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed's ZeRO wrapper holds the torch optimizer
    state = getattr(inner, "state", None)
    if state is None or not hasattr(state, "values"):  # a dict, or a torch optimizer's state (a defaultdict)
        return 0
    seen: set[int] = set()
    untied = 0
    for entry in state.values():
        step = entry.get("step") if isinstance(entry, dict) else None
        if torch.is_tensor(step):
            if id(step) in seen:
                entry["step"] = step.clone()
                untied += 1
            seen.add(id(step))
    return untied
