"""Bounded waits for the preflight: a child process or a check that hangs becomes a failed result, never a hang.

``run(argv, timeout_s)`` starts a tool (fio, nvidia-smi, nc, iperf3) in its own process group with its output
in temporary files (a grandchild holding a pipe open cannot stall the read); on timeout the whole group gets
SIGTERM, then SIGKILL, and a process that still does not go (stuck in D state on a dead disk or a GPU fault)
is left behind rather than waited for. ``Calls`` runs check functions in daemon threads
(a thread blocked in the kernel must not keep the process alive at exit either) and turns the ones that
did not return by the deadline into failed ``CheckResult``s naming the node and the check.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from .results import CheckResult

TERM_GRACE_S = 2.0  # SIGTERM to SIGKILL
KILL_WAIT_S = 2.0  # after SIGKILL: a process still there is in D state; give up on it


@dataclass(frozen=True)
class Finished:
    """What a bounded child did: ``returncode`` None when it had to be killed (``timed_out``)."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    unkillable: bool = False  # still there after SIGKILL (D state): left behind

    def describe_timeout(self, tool: str, timeout_s: float) -> str:
        tail = "; it did not die even of SIGKILL (stuck in the kernel, D state)" if self.unkillable else "; killed"
        return f"{tool} did not finish within {timeout_s:g} s{tail}"


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _read(fh: Any) -> str:
    fh.seek(0)
    return fh.read().decode("utf-8", "replace")


def stop(proc: subprocess.Popen) -> bool:
    """SIGTERM the child's process group, then SIGKILL; True when the child is gone (bounded: never waits
    more than TERM_GRACE_S + KILL_WAIT_S)."""
    if proc.poll() is not None:
        return True
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc.pid, signal.SIGKILL)  # the rest of the group too, even when the leader went on TERM
    try:
        proc.wait(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        return False
    return True


def spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen:
    """Popen in a new session (its own process group, which ``stop`` signals as a whole)."""
    return subprocess.Popen(argv, start_new_session=True, **kwargs)


def run(argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> Finished:
    """Run ``argv`` to completion or ``timeout_s``, whichever first; bounded by timeout_s + TERM_GRACE_S + KILL_WAIT_S.

    Raises OSError only when the program cannot be started (a missing tool is checked before)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = spawn(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            gone = stop(proc)
            return Finished(None, _read(out), _read(err), timed_out=True, unkillable=not gone)
        return Finished(code, _read(out), _read(err))


class Calls:
    """Check functions running in daemon threads from ``start``; ``collect(deadline)`` waits for them until a
    monotonic deadline. A call still running then is a failed result naming its check and node; one that
    raised is a failed result too (a bug in one check must not hide the others)."""

    def __init__(self) -> None:
        self._running: list[tuple[str, str, float, dict[str, Any], threading.Thread]] = []

    def start(self, check: str, node: str, fn: Callable[[], list[CheckResult]]) -> None:
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["results"] = list(fn())
            except Exception as exc:
                box["error"] = f"{type(exc).__name__}: {exc}"

        thread = threading.Thread(target=work, name=f"preflight-{check}-{node}", daemon=True)
        thread.start()
        self._running.append((check, node, time.monotonic(), box, thread))

    def collect(self, deadline: float) -> list[CheckResult]:
        """Results in the order started; waits at most until ``deadline``."""
        for *_, thread in self._running:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        out: list[CheckResult] = []
        for check, node, started, box, _ in self._running:
            if "results" in box:
                out += box["results"]
            elif "error" in box:
                out.append(CheckResult(check, node, False, f"the {check} check crashed on {node}: {box['error'][:200]}", "a result",
                                       "a bug in swiftslurm's preflight: report it with this message"))
            else:
                out.append(hung(check, node, deadline - started))
        self._running = []
        return out


def hung(check: str, node: str, waited_s: float) -> CheckResult:
    """The result for a check that did not return in time (a tool or a filesystem stuck in the kernel)."""
    return CheckResult(
        check, node, False, f"the {check} check on {node} did not finish within {waited_s:.0f} s (hung)", "finishes in time",
        f"something on {node} hangs (a disk, filesystem or GPU stuck in the kernel?): look for processes in D state "
        f"(`ps -eo pid,stat,cmd | awk '$2 ~ /D/'`) and dmesg on {node}; drain or exclude it",
    )
