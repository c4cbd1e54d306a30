"""``PYTHON -m swiftslurm.node.hold -u -m submitit.core._submit FOLDER``: how a rank of a submitit Slurm job starts.

Slurm's walltime USR2 reaches every process of a step, and a step can start late in its allocation (an in-job
restart). Before any handler exists, USR2's default action kills the rank; after submitit's own handler is in and
before swiftslurm's, it is taken by submitit, which fails rank 0 as "timed-out and not checkpointable" and drops it
on the others. So, as ``python -m swiftslurm run`` does for a rendered script (``swiftslurm/__main__.py``), this
holds USR2 blocked from the first line and then runs the module it was given, as ``python -u -m MODULE`` would;
``node.signals.install`` replaces submitit's handler and unblocks it, and a USR2 that came meanwhile is then
swiftslurm's walltime stop. Only the standard library is imported before the module runs.
"""

from __future__ import annotations

import io
import os
import runpy
import signal
import sys


def _unbuffered() -> None:
    """What ``python -u`` does to stdout and stderr: text written straight through to an unbuffered file."""
    os.environ["PYTHONUNBUFFERED"] = "1"  # and to the processes the module starts
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and hasattr(stream, "fileno"):
            raw = io.FileIO(stream.fileno(), "w", closefd=False)
            setattr(sys, name, io.TextIOWrapper(raw, encoding=stream.encoding, errors=stream.errors, write_through=True))


def hold_walltime_signal() -> None:
    """Block USR2 in this thread (and so in the threads and processes it starts) until ``signals.install``."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})


def main(argv: list[str]) -> None:
    hold_walltime_signal()
    args = list(argv)
    if args[:1] == ["-u"]:
        args.pop(0)
        _unbuffered()
    if len(args) < 2 or args[0] != "-m":
        sys.exit("usage: python -m swiftslurm.node.hold [-u] -m MODULE [ARGS...]")
    sys.argv = [args[1], *args[2:]]
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
