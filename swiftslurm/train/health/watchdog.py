"""The progress watchdog on every rank: no training step for K x the median step time, and every thread's Python
stack goes into the rank's stderr (its submitit log; rank 0's too), so a rank stuck in a collective, in C code or
asleep is dumped all the same. At the same moment ``py-spy dump`` runs on the rank when py-spy is installed
(idle/active per thread, into the same stderr), the rank dumps its flight record (``frtrace``: which collective it
entered last) next to torch's own dump path, and rank 0 waits a little for every rank's record and logs which
collective each rank is in and who never joined. `doctor` reads both: the ranks inside a collective waited for
the rank whose record stops before it (docs/doctor.md).

Each step end re-arms a timer with the limit (pure ``limit_s``): K (10) x the median of the last steps, at least
``FLOOR_S``, and at most ``CAP_FRACTION`` of the process-group timeout, so the dump comes before the collective
times out. Nothing is armed before ``WARMUP_STEPS`` steps (compilation, the first gathers), nor during a checkpoint
save (``pause``). A ``train.command`` script has no steps to watch: there, USR1 dumps.

Under the in-job restart supervisor (``slurm.max_restarts``; it sets ``SWIFTSLURM_HANG_RESTART=1`` in the step),
a stall also ends the step: once the stacks are out and rank 0 has its verdict, rank 0 writes ``logs/hang.json``
(the rank and node that stopped, when the flight records name one) and exits with ``HANG_EXIT``, which ends the
step (``srun --kill-on-bad-exit``), so the supervisor restarts it from the newest verified checkpoint instead of
the job waiting out the collective timeout. Only rank 0 exits: it is the one that gathers the verdict.

Who writes the stacks: the timer's Python thread, with ``faulthandler.dump_traceback`` while it holds the GIL.
faulthandler's own timed dump (``dump_traceback_later``) walks the other threads' frames from a C thread without
the GIL, and a thread that runs Python code meanwhile changes them under it: the rank dies of SIGSEGV (a script
that dumps while two threads recurse crashes in every run). The timer's thread started at the limit is such a
thread. faulthandler's C thread stays armed as the backup, ``BACKUP_MIN_S`` (or the limit, if longer) after the
limit, and the timer's first act cancels it: it fires only when no Python thread got the GIL for that long, i.e.
when a thread holds the GIL in C code, and then no frame moves under it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ...fsutil import atomic_write_text
from . import frtrace

K = 10
FLOOR_S = 60.0
CAP_FRACTION = 0.8
WARMUP_STEPS = 3
WINDOW = 50  # the median over this many recent steps
FLOOR_ENV = "SWIFTSLURM_WATCHDOG_FLOOR_S"  # tests: a shorter floor
STALL_ENV = "SWIFTSLURM_TEST_STALL"  # tests: "RANK:STEP:SECONDS[:every]" makes that rank sleep after that step
# tests: a step takes at least this long (seconds), so a walltime test needs as many requeues on any machine
MIN_STEP_ENV = "SWIFTSLURM_TEST_MIN_STEP_S"
PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, 2**64 - 1  # prctl(2)
SPY_TIMEOUT_S = 60
BACKUP_MIN_S = 30.0  # faulthandler's C-thread dump, only if the timer's thread got no GIL this long after the limit
BACKUP_ENV = "SWIFTSLURM_WATCHDOG_BACKUP_S"  # tests: a shorter BACKUP_MIN_S
STOP_WAIT_S = 10.0  # ``stop`` waits at most this long for a dump already being written
GATHER_S = 20.0  # rank 0 waits at most this long (and at most the limit) for the other ranks' flight records
HANG_RESTART_ENV = "SWIFTSLURM_HANG_RESTART"  # "1": the supervisor restarts a hung step; rank 0 ends it
ATTEMPT_ENV = "SWIFTSLURM_RESTART_ATTEMPT"  # in-job restarts before this step (the supervisor sets it; absent = 0)
HANG_EXIT = 86  # rank 0's exit code when it ends a hung step for the supervisor to restart


def limit_s(durations: list[float], timeout_s: float, k: float = K, floor_s: float = FLOOR_S) -> float | None:
    """Seconds without a step end before the stacks are dumped; None while warming up (pure)."""
    if len(durations) < WARMUP_STEPS:
        return None
    return min(max(k * statistics.median(durations[-WINDOW:]), floor_s), CAP_FRACTION * timeout_s)


class ProgressWatchdog:
    def __init__(self, rank: int, timeout_s: float, target: Any = None, environ: dict[str, str] | None = None,
                 world_size: int = 1, node: str = "", hang_file: str | os.PathLike[str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.hang_file = hang_file if env.get(HANG_RESTART_ENV) == "1" else None  # where rank 0 says why it ends the step
        self.rank = rank
        self.world_size = world_size
        self.node = node
        self.fr_prefix = env.get(frtrace.PREFIX_ENV, "")
        self._timer: threading.Timer | None = None
        # one dump at a time: a timer still dumping when the next one fires (a step ended and stalled again meanwhile)
        # would interleave its header and threads with the next dump's, and neither would read as one dump
        self._dumping = threading.Lock()
        self.timeout_s = timeout_s
        self.target = target if target is not None else sys.stderr
        self.floor_s = float(env.get(FLOOR_ENV) or FLOOR_S)
        self.backup_s = float(env.get(BACKUP_ENV) or BACKUP_MIN_S)
        # the test hook stalls the first attempt only: a restarted step resumes before that step and must get past it;
        # "RANK:STEP:SECONDS:every" stalls every attempt (a hang that a restart cannot cure: the progress guard's case)
        every = env.get(STALL_ENV, "").endswith(":every")
        self.stall = _parse_stall(env.get(STALL_ENV, "").removesuffix(":every")) if every or env.get(ATTEMPT_ENV, "0") in ("", "0") else None
        try:
            self.min_step_s = max(0.0, float(env.get(MIN_STEP_ENV) or 0.0))
        except ValueError:
            self.min_step_s = 0.0
        self.durations: list[float] = []
        self._last: float | None = None

    def step_done(self, step: int) -> None:
        now = time.monotonic()
        if self.min_step_s and self._last is not None and now - self._last < self.min_step_s:
            time.sleep(self.min_step_s - (now - self._last))  # the test hook: a slower machine, the same math
            now = time.monotonic()
        if self._last is not None:
            self.durations.append(now - self._last)
        self._last = now
        limit = limit_s(self.durations, self.timeout_s, floor_s=self.floor_s)
        if limit is not None:
            self._arm(limit)
        if self.stall and self.stall[0] == self.rank and self.stall[1] == step:
            time.sleep(self.stall[2])  # the test hook: this rank stops making progress here

    @property
    def armed_s(self) -> float | None:
        """The limit the watchdog is armed with now; None while paused (a save) or before the first limit."""
        timer = self._timer
        return timer.interval if timer is not None and timer.is_alive() else None

    def _arm(self, limit: float) -> None:
        import faulthandler

        self._cancel_timer()
        try:  # the backup for a GIL held in C code; the timer cancels it before anything else (module docstring)
            faulthandler.dump_traceback_later(limit + max(limit, self.backup_s), repeat=False, file=self.target, exit=False)
        except (ValueError, RuntimeError, OSError, AttributeError):  # no real file behind stderr: no dumps from C
            pass
        self._timer = threading.Timer(limit, self._fire, (limit,))
        self._timer.daemon = True
        self._timer.start()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self, limit: float) -> None:
        """No step for ``limit`` s (this runs in the timer's thread while the main one is stuck): dump every thread's
        stack and this rank's flight record; rank 0 then gathers every rank's record and logs where each one is."""
        import faulthandler

        faulthandler.cancel_dump_traceback_later()  # first: no C-thread dump may walk frames while this thread runs
        fired = time.time()
        with self._dumping:
            self._dump_stacks(limit)
            if self.fr_prefix:
                frtrace.write_dump(self.fr_prefix, self.rank, self.node, fired)
            self._py_spy(limit)
        if self.rank != 0 or self.world_size < 2 or not self.fr_prefix:
            if self.rank == 0:
                self._end_hung_step(limit, None, {})
            return
        since = fired - limit  # records of this stall, not of an earlier one
        deadline = time.monotonic() + min(GATHER_S, limit)
        records = frtrace.read_dumps(self.fr_prefix, since)
        while len(records) < self.world_size and time.monotonic() < deadline:
            time.sleep(0.5)
            records = frtrace.read_dumps(self.fr_prefix, since)
        found = frtrace.verdict(records, list(range(self.world_size)))
        log = logging.getLogger("swiftslurm.train")
        if found is None:
            lines = [f"no step for {limit:.0f} s; the flight records of {len(records)} rank(s) show no rank "
                             "missing from a collective (stacks above)"]
        else:
            lines = frtrace.describe(found, frtrace.nodes_of(records))
        for line in lines:
            log.warning("watchdog: %s", line)
        self._end_hung_step(limit, found, frtrace.nodes_of(records))

    def _end_hung_step(self, limit: float, found: frtrace.Verdict | None, nodes: dict[int, str]) -> None:
        """Under the restart supervisor: rank 0 records the verdict and ends the step (module docstring)."""
        if self.hang_file is None:
            return
        culprit = found.culprits[0] if found is not None and found.culprits else (0 if self.world_size == 1 else None)
        node = (self.node if culprit == 0 and self.world_size == 1 else nodes.get(culprit, "")) if culprit is not None else ""
        detail = frtrace.describe(found, nodes)[-1] if found is not None else "no rank named by the flight records"
        record = {"rank": culprit, "node": node, "limit_s": round(limit), "detail": detail, "time": time.time()}
        try:
            atomic_write_text(Path(self.hang_file), json.dumps(record))
        except OSError:
            pass
        logging.getLogger("swiftslurm.train").error("watchdog: no step for %.0f s: ending the step for an in-job restart (%s)", limit, detail)
        os._exit(HANG_EXIT)

    def _dump_stacks(self, limit: float) -> None:
        """Every thread's Python stack, by faulthandler, from this thread: it holds the GIL, so no frame moves."""
        import faulthandler

        try:
            self.target.write(f"watchdog: no step for {limit:.0f} s: stacks of rank {self.rank} (pid {os.getpid()})\n")
            self.target.flush()
            faulthandler.dump_traceback(file=self.target, all_threads=True)
        except (ValueError, RuntimeError, OSError, AttributeError):  # no real file behind the target
            pass

    def _py_spy(self, limit: float) -> None:
        """``py-spy dump`` of this process into the rank's stderr, when py-spy is installed (the train extra has it):
        each thread's Python frames and whether it is idle or active, as seen from outside the interpreter."""
        exe = shutil.which("py-spy")
        if exe is None:
            return
        try:
            import ctypes

            # Yama's ptrace_scope 1 lets only ancestors trace: allow our child (an EINVAL without Yama is fine)
            ctypes.CDLL(None).prctl(PR_SET_PTRACER, ctypes.c_ulong(PR_SET_PTRACER_ANY), 0, 0, 0)
            out = subprocess.run([exe, "dump", "--pid", str(os.getpid())], capture_output=True, text=True, timeout=SPY_TIMEOUT_S)
            text = out.stdout if out.returncode == 0 else f"py-spy could not dump this rank: {(out.stderr or out.stdout).strip()[:300]}\n"
            self.target.write(f"watchdog: no step for {limit:.0f} s: py-spy dump of rank {self.rank} (pid {os.getpid()})\n{text}")
            self.target.flush()
        except (OSError, ValueError, AttributeError, subprocess.SubprocessError):
            pass

    def pause(self) -> None:
        """No dump until the next step end (a checkpoint save follows: it may take longer than any step)."""
        import faulthandler

        faulthandler.cancel_dump_traceback_later()
        self._cancel_timer()

    def stop(self) -> None:
        """``pause`` for good, and let a dump that has begun (its timer fired just before the last step ended) finish
        whole in the log before the rank goes on to exit: a daemon thread is cut off mid-dump at interpreter exit."""
        timer = self._timer
        self.pause()
        if timer is not None and timer is not threading.current_thread():
            timer.join(STOP_WAIT_S)  # a cancelled timer that had not fired ends at once


def _parse_stall(text: str) -> tuple[int, int, float] | None:
    parts = text.split(":")
    try:
        return (int(parts[0]), int(parts[1]), float(parts[2])) if len(parts) == 3 else None
    except ValueError:
        return None
