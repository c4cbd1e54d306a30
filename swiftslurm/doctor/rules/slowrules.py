"""The ``straggler`` finding: a rank the trainer named slow (train/health/straggler.py wrote a metrics.jsonl row with
``straggler_rank``, ``straggler_node`` and ``straggler_ratio``), one finding per rank, with its node and ratio (pure)."""

from __future__ import annotations

from typing import Any

from ...taskdir import METRICS_FILE
from ..evidence import TaskRun
from ..findings import Evidence, Finding


def _named(row: dict[str, Any]) -> tuple[int, str, float] | None:
    rank, node, ratio = row.get("straggler_rank"), row.get("straggler_node"), row.get("straggler_ratio")
    if isinstance(rank, bool) or not isinstance(rank, int) or not isinstance(node, str) or isinstance(ratio, bool) \
            or not isinstance(ratio, (int, float)):
        return None  # not a row the trainer wrote
    return rank, node[:128], float(ratio)


def straggler(run: TaskRun) -> list[Finding]:
    """Each rank named as a straggler (its latest naming: a requeued run may name it again)."""
    latest: dict[int, tuple[int, dict[str, Any], str, float]] = {}
    for number, row in run.metrics:
        named = _named(row)
        if named is not None:
            latest[named[0]] = (number, row, named[1], named[2])
    out = []
    for rank, (number, row, node, ratio) in sorted(latest.items()):
        step = row.get("step") if isinstance(row.get("step"), int) else None
        windows = row.get("straggler_windows")
        where = f" on {node}" if node else ""
        out.append(Finding(
            "straggler",
            f"rank {rank}{where} was {ratio:.2f}x slower than the other ranks' median"
            + (f" for {windows} windows in a row" if isinstance(windows, int) else ""),
            "its steps take longer outside the collectives, so every other rank waits for it at each gradient all-reduce "
            "(a slower or busier node: another job's processes, thermal throttling, a slow local disk or data path)",
            "look at the node (`swiftslurm nodes` lists it as slow; top/nvidia-smi there); exclude it with slurm.exclude "
            "if it stays slow; train.straggler_factor sets how much slower counts",
            keys=("slurm.exclude", "train.straggler_factor"),
            evidence=(Evidence(METRICS_FILE, number, rank, node, step, f"straggler_ratio = {ratio:.3g}"),),
            task=run.task, ranks=(rank,), nodes=(node,) if node else (),
        ))
    return out
