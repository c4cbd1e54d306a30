"""Stragglers: a rank whose steps take longer than the others', window after window, is named.

Every ``train.straggler_window`` steps each rank shares how long its steps took *without* the time it spent inside
collectives (one all-gather of one number): in data parallel training every rank waits for the slowest at the
gradient all-reduce, so whole step times are equal everywhere and only the time outside the collectives shows
who makes the others wait. A rank whose time is more than ``train.straggler_factor`` x the median of the other
ranks' for ``WINDOWS_IN_ROW`` windows in a row is named once: in rank 0's log, in ``metrics.jsonl`` (a row with
``straggler_rank``, ``straggler_node``, ``straggler_ratio``) and in the node-health ledger as ``slow`` (a mark
that never excludes the node: ``ledger.avoid``). Every window also logs ``straggler_max_ratio`` and its rank, the
spread the factor is chosen against (docs/runtime.md, "Stragglers").

The time inside collectives is what ``metrics.CommTimer`` measures on the host: exact on the CPU (gloo is
synchronous). On GPUs NCCL's collectives return once queued, so the wait for a slow peer is not on the host's clock
and the shared time is close to the whole step on every rank: there a straggler is seen only when it is slow on the
host side (its data loading, its Python), not when its GPU is.

``decide`` and ``ratios`` are pure; ``StragglerWatch`` holds the window (the one all-gather per window), behind the
trainer's seam ``trainer.StragglerCallback``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

WINDOWS_IN_ROW = 3  # windows a rank must be slow in a row before it is named (one slow window is noise)
SLOW_ENV = "SWIFTSLURM_TEST_SLOW_RANK"  # tests: "RANK:SECONDS" makes that rank sleep this long inside every step

log = logging.getLogger("swiftslurm.train")


def ratios(times: list[float]) -> list[float]:
    """Each rank's time over the median of the *other* ranks' (pure): with two ranks the median of all would be their
    mean, and no rank could ever be 2x it. One rank, or others that took no time: every ratio 1.0.

    One sort for all ranks (O(W log W); rank 0 runs this each window while every other rank waits at the next
    collective): leaving out the value at sorted position ``i`` shifts the positions after it by one, so the median
    of the others is read off the same sorted list."""
    n = len(times)
    if n < 2:
        return [1.0] * n
    order = sorted(range(n), key=times.__getitem__)
    ranked = [times[r] for r in order]
    where = [0] * n
    for position, rank in enumerate(order):
        where[rank] = position
    half, odd = divmod(n - 1, 2)

    def other(k: int, left_out: int) -> float:  # the k-th smallest of the others
        return ranked[k] if k < left_out else ranked[k + 1]

    out = []
    for rank, own in enumerate(times):
        i = where[rank]
        median = other(half, i) if odd else (other(half - 1, i) + other(half, i)) / 2
        out.append(own / median if median > 0 else 1.0)
    return out


@dataclass
class Named:
    rank: int
    ratio: float  # this window's
    windows: int  # slow windows in a row so far


@dataclass
class StragglerState:
    """Per rank: slow windows in a row; and the ranks already named (each is named once per run)."""

    in_row: dict[int, int] = field(default_factory=dict)
    named: set[int] = field(default_factory=set)


def decide(state: StragglerState, times: list[float], factor: float, windows: int = WINDOWS_IN_ROW) -> list[Named]:
    """One window (pure but for ``state``): the ranks named by it, i.e. slow for the ``windows``-th time in a row."""
    out = []
    for rank, ratio in enumerate(ratios(times)):
        state.in_row[rank] = state.in_row.get(rank, 0) + 1 if ratio > factor else 0
        if state.in_row[rank] >= windows and rank not in state.named:
            state.named.add(rank)
            out.append(Named(rank, ratio, state.in_row[rank]))
    return out


def _slow_hook(environ: Any, rank: int) -> float:
    """Seconds this rank sleeps in every step (the test hook), 0.0 without it or when it names another rank."""
    text = environ.get(SLOW_ENV, "")
    who, _, seconds = text.partition(":")
    try:
        return max(0.0, float(seconds)) if who.strip() == str(rank) else 0.0
    except ValueError:
        return 0.0


class StragglerWatch:
    """Every ``window`` steps: one all-gather of each rank's seconds outside collectives; rank 0 names stragglers.
    The trainer's ``StragglerCallback`` (train/trainer.py) calls ``step_begin``/``step_end``."""

    def __init__(self, window: int, factor: float, meter: Any, rank: int, node: str, job_id: str, executor: str,
                 out_dir: str, metrics: Any = None, environ: Any = None) -> None:
        self.window, self.factor, self.meter = window, factor, meter
        self.rank, self.node, self.job_id, self.executor, self.out_dir = rank, node, job_id, executor, out_dir
        self.metrics = metrics  # rank 0: a metrics.MetricsFile
        self.sleep_s = _slow_hook(os.environ if environ is None else environ, rank)
        self.own_s = 0.0
        self.steps = 0
        self.nodes: list[str] | None = None
        self.state = StragglerState()

    def step_begin(self) -> None:
        if self.sleep_s:
            time.sleep(self.sleep_s)  # the test hook: inside the measured step, outside any collective

    def step_end(self, step: int, device: Any) -> None:
        step_s = self.meter.last_step_s or 0.0
        self.own_s += max(0.0, step_s - getattr(self.meter, "last_comm_s", 0.0))
        self.steps += 1
        if step % self.window == 0:
            self._window(step, device)

    def _window(self, step: int, device: Any) -> None:
        import torch
        import torch.distributed as tdist

        mean = self.own_s / self.steps
        self.own_s, self.steps = 0.0, 0
        if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() < 2:
            return
        world = tdist.get_world_size()
        if self.nodes is None:  # once: which node each rank runs on
            nodes: list[Any] = [None] * world
            tdist.all_gather_object(nodes, self.node)
            self.nodes = [str(n) for n in nodes]
        own = torch.tensor([mean], dtype=torch.float64, device=device)
        parts = [torch.zeros_like(own) for _ in range(world)]
        tdist.all_gather(parts, own)
        if self.rank != 0:
            return
        times = [float(p.item()) for p in parts]
        spread = ratios(times)
        worst = max(range(world), key=lambda r: spread[r])
        row: dict[str, Any] = {"straggler_max_ratio": spread[worst], "straggler_max_rank": worst}
        for named in decide(self.state, times, self.factor):
            node = self.nodes[named.rank]
            row.update(straggler_rank=named.rank, straggler_node=node, straggler_ratio=named.ratio, straggler_windows=named.windows)
            log.warning("straggler: rank %d on %s took %.2fx the other ranks' median time outside collectives for %d windows "
                        "of %d steps in a row (up to step %d; train.straggler_factor = %g)",
                        named.rank, node, named.ratio, named.windows, self.window, step, self.factor)
            self._remember(node, named, step)
        if self.metrics is not None:
            self.metrics.write(step, row)

    def _remember(self, node: str, named: Named, step: int) -> None:
        """The ledger's ``slow`` mark (Slurm jobs only: a local run's node is this machine); never fails training."""
        if self.executor != "slurm":
            return
        from ...ledger import Entry, record

        detail = f"rank {named.rank} {named.ratio:.2f}x the median step time for {named.windows} windows (step {step})"
        try:
            record([Entry(node, "slow", detail, self.job_id, 0.0, self.out_dir)])
        except Exception as exc:  # noqa: BLE001 -- a ledger that cannot be written is a note, not a failed run
            log.warning("straggler: could not record %s in the node-health ledger: %s", node, exc)
