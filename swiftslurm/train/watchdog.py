"""The progress watchdog on every rank: no training step for K x the median step time, and every thread's Python
stack goes into the rank's stderr (its submitit log; rank 0's too), written by faulthandler's own C thread, so a
rank stuck in a collective, in C code or asleep is dumped all the same. `doctor` reads the dumps: the ranks inside a
collective waited for the rank whose stack is elsewhere (docs/doctor.md).

Each step end re-arms ``faulthandler.dump_traceback_later`` with the limit (pure ``limit_s``): K (10) x the median of
the last steps, at least ``FLOOR_S``, and at most ``CAP_FRACTION`` of the process-group timeout, so the dump comes
before the collective times out. Nothing is armed before ``WARMUP_STEPS`` steps (compilation, the first gathers),
nor during a checkpoint save (``pause``). A ``train.command`` script has no steps to watch: there, USR1 dumps.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

K = 10
FLOOR_S = 60.0
CAP_FRACTION = 0.8
WARMUP_STEPS = 3
WINDOW = 50  # the median over this many recent steps
FLOOR_ENV = "SWIFTSLURM_WATCHDOG_FLOOR_S"  # tests: a shorter floor
STALL_ENV = "SWIFTSLURM_TEST_STALL"  # tests: "RANK:STEP:SECONDS" makes that rank sleep after that step


def limit_s(durations: list[float], timeout_s: float, k: float = K, floor_s: float = FLOOR_S) -> float | None:
    """Seconds without a step end before the stacks are dumped; None while warming up (pure)."""
    if len(durations) < WARMUP_STEPS:
        return None
    return min(max(k * statistics.median(durations[-WINDOW:]), floor_s), CAP_FRACTION * timeout_s)


class ProgressWatchdog:
    def __init__(self, rank: int, timeout_s: float, target: Any = None, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.rank = rank
        self.timeout_s = timeout_s
        self.target = target if target is not None else sys.stderr
        self.floor_s = float(env.get(FLOOR_ENV) or FLOOR_S)
        self.stall = _parse_stall(env.get(STALL_ENV, ""))
        self.durations: list[float] = []
        self._last: float | None = None
        self.armed_s: float | None = None

    def step_done(self, step: int) -> None:
        now = time.monotonic()
        if self._last is not None:
            self.durations.append(now - self._last)
        self._last = now
        limit = limit_s(self.durations, self.timeout_s, floor_s=self.floor_s)
        if limit is not None:
            self._arm(limit)
        if self.stall and self.stall[0] == self.rank and self.stall[1] == step:
            time.sleep(self.stall[2])  # the test hook: this rank stops making progress here

    def _arm(self, limit: float) -> None:
        import faulthandler

        try:
            faulthandler.dump_traceback_later(limit, repeat=False, file=self.target, exit=False)
            self.armed_s = limit
        except (ValueError, RuntimeError, OSError, AttributeError):  # no real file behind stderr: no dumps
            self.armed_s = None

    def pause(self) -> None:
        """No dump until the next step end (a checkpoint save follows: it may take longer than any step)."""
        import faulthandler

        faulthandler.cancel_dump_traceback_later()
        self.armed_s = None

    stop = pause


def _parse_stall(text: str) -> tuple[int, int, float] | None:
    parts = text.split(":")
    try:
        return (int(parts[0]), int(parts[1]), float(parts[2])) if len(parts) == 3 else None
    except ValueError:
        return None
