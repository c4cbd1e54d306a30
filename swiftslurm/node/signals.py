"""Signal plumbing on a rank: handlers only record that a signal came (STYLE.md, 9).

SIGUSR2 (Slurm's ``--signal=USR2@grace`` before the time limit) means "save and stop, you will be
requeued": ``stop_requested()`` turns true, the trainer polls it at step boundaries. With
``forward=True`` (a user's ``train.command`` runs as a child) SIGUSR2 and SIGTERM are also queued,
and the runtime's wait loop forwards them to the child; the handler itself does nothing else.

submitit installs its own SIGUSR2 handler before calling the job function; ``install`` replaces it.
``python -m swiftslurm run`` holds SIGUSR2 blocked until ``install`` (``swiftslurm/__main__.py``), so a walltime
signal during the rank's imports is not lost and does not kill it.
"""

from __future__ import annotations

import signal
import threading

_stop = threading.Event()
_received: list[int] = []  # signals not yet forwarded to a child (appended in the handler only)


def _handler(signum: int, frame) -> None:  # noqa: ARG001 - signal handler signature
    if signum == signal.SIGUSR2:
        _stop.set()
    _received.append(signum)


def install(forward_term: bool = False) -> bool:
    """Install the USR2 flag handler (and a TERM one when a child gets the signals forwarded).

    Returns False where handlers cannot be installed (not the main thread).
    """
    _stop.clear()
    _received.clear()
    try:
        signal.signal(signal.SIGUSR2, _handler)
        if forward_term:
            signal.signal(signal.SIGTERM, _handler)
    except ValueError:  # not in the main thread
        return False
    # `python -m swiftslurm run` held USR2 pending from its first line (swiftslurm/__main__.py): one that came during
    # the imports is delivered to the handler now, and children started from here on get USR2 unblocked
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})
    return True


def stop_requested() -> bool:
    """True once SIGUSR2 arrived: save at the next step boundary and stop for a requeue."""
    return _stop.is_set()


def take_received() -> list[int]:
    """Signals received since the last call, oldest first (for forwarding to a child)."""
    taken = []
    while _received:
        taken.append(_received.pop(0))
    return taken
