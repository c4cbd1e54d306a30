"""The start-up watchdog: a rank's start (the training stack's imports, DeepSpeed's op builds, the model's load,
``deepspeed.initialize`` and the checkpoint's load) gets a limit, and a rank still starting when it runs out says
where it is stuck instead of waiting out its walltime at 0% CPU.

The progress watchdog (``watchdog.py``) arms only once steps run; before that nothing watched, and a start that
waits forever (a build lock left by a dead rank, a rendezvous whose peer never came) wasted the whole allocation with
no word. Here the phases of the start are marked as they begin (``mark``: "building DeepSpeed's ShareMemCommBuilder in
...", "waiting for the op build lock ..., held by pid 12 on node2"), the trainer's ``on_train_begin`` ends the watch
(``done``), and at the limit the watch's thread dumps every thread's stack into the rank's stderr, hands the
diagnosis (the phase it is stuck in and for how long) to ``on_expire`` (the node runtime writes it as the rank's
failure record and logs it, for ``status``, ``logs --errors`` and ``doctor``), and ends the rank with
``STARTUP_HANG_EXIT``.

One watch per process, current while its ``watching`` block runs; ``mark`` and ``done`` without one do nothing, so
the trainer also runs where no runtime armed one (tests, benchmarks).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

STARTUP_HANG_EXIT = 87  # a rank ended by this watch (86 is the progress watchdog's HANG_EXIT)
LIMIT_ENV = "SWIFTSLURM_STARTUP_LIMIT_S"  # tests: a shorter limit
STUCK = "start-up did not finish within"  # the first words of the diagnosis (doctor's startup_hang rule reads them)

log = logging.getLogger("swiftslurm.train")


class StartupWatch:
    def __init__(self, limit_s: float, on_expire: Callable[[str], None]) -> None:
        self.limit_s = limit_s
        self.on_expire = on_expire
        self._phase = "starting"
        self._phase_since = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="swiftslurm-startup-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def mark(self, phase: str) -> None:
        if phase != self._phase:
            self._phase, self._phase_since = phase, time.monotonic()

    def done(self) -> None:
        self._done.set()

    def diagnosis(self) -> str:
        stuck_s = time.monotonic() - self._phase_since
        return f"{STUCK} {self.limit_s:.0f} s: stuck for {stuck_s:.0f} s {self._phase}"

    def _run(self) -> None:
        if self._done.wait(self.limit_s):
            return
        what = self.diagnosis()
        try:
            sys.stderr.write(f"swiftslurm: {what}; every thread's stack follows\n")
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            self.on_expire(what)
        finally:
            logging.shutdown()
            os._exit(STARTUP_HANG_EXIT)


_current: StartupWatch | None = None


FLOOR_S = 1800.0  # a start may load a large model from a slow filesystem: never less than this


def limit_s(ddp_timeout: int | None) -> float:
    """The start-up limit: the process-group timeout (``train.ddp_timeout``), the longest a peer waits in the
    rendezvous for this rank anyway, and at least ``FLOOR_S`` (a short ddp_timeout bounds collectives, not a model's
    load); ``$SWIFTSLURM_STARTUP_LIMIT_S`` overrides it (tests)."""
    chosen = max(FLOOR_S, float(ddp_timeout or 0))
    raw = os.environ.get(LIMIT_ENV, "")
    try:
        return max(1.0, float(raw)) if raw else chosen
    except ValueError:
        return chosen


@contextlib.contextmanager
def watching(limit: float, on_expire: Callable[[str], None]) -> Iterator[StartupWatch]:
    """Arm a watch for this block (the rank's start and its training); it is ended by ``done`` or by leaving."""
    global _current
    watch = StartupWatch(limit, on_expire)
    previous, _current = _current, watch
    watch.start()
    try:
        yield watch
    finally:
        watch.done()
        _current = previous


def mark(phase: str) -> None:
    """The start has entered ``phase`` (words that finish "stuck for N s ...")."""
    if _current is not None:
        _current.mark(phase)


def done() -> None:
    """The start is over: training begins."""
    if _current is not None:
        _current.done()
