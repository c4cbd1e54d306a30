"""The ledger's exclusion applied to a plan: one decision per allocation group, written into each task's
``slurm.exclude`` so the sbatch call, the plan file and ``spec.json`` all carry what was sent (pure but for the
partition lookup the caller passes in)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from ..plan import Plan
from .avoid import Avoidance, avoid
from .store import Entry, recent

if TYPE_CHECKING:
    from ..spec.model import JobSpec


def _with_exclude(spec: JobSpec, exclude: str | None) -> JobSpec:
    return spec.model_copy(update={"slurm": spec.slurm.model_copy(update={"exclude": exclude})})


def avoid_in_plan(plan: Plan, entries: list[Entry], nodes_of: Callable[[str | None], list[str] | None],
                  now: float | None = None) -> tuple[Plan, list[tuple[int, Avoidance]]]:
    """(the plan with recently failed nodes excluded, each group's decision). A group with
    ``slurm.avoid_bad_nodes = false`` or no recent failures is left as it is. ``nodes_of(partition)``: the usable
    nodes of a partition (None: unknown)."""
    now = time.time() if now is None else now
    decisions: list[tuple[int, Avoidance]] = []
    exclude_of: dict[int, str | None] = {}
    partitions: dict[str | None, list[str] | None] = {}
    for group in plan.groups:
        s = group.slurm
        if not s.avoid_bad_nodes:
            continue
        bad = recent(entries, now, s.bad_node_ttl_h)
        if not bad:
            continue
        if s.partition not in partitions:
            partitions[s.partition] = nodes_of(s.partition)
        decision = avoid(bad, s.exclude, s.nodelist, partitions[s.partition], s.nodes)
        if decision.excluded or decision.notes:
            decisions.append((group.index, decision))
        if decision.excluded:
            for task in group.tasks:
                exclude_of[task] = decision.exclude
    if not exclude_of:
        return plan, decisions
    tasks = [replace(t, spec=_with_exclude(t.spec, exclude_of[t.index])) if t.index in exclude_of else t for t in plan.tasks]
    spec = _with_exclude(plan.spec, exclude_of[0]) if len(plan.groups) == 1 and 0 in exclude_of else plan.spec
    return replace(plan, tasks=tasks, spec=spec), decisions
