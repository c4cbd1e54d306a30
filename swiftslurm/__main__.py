"""``python -m swiftslurm`` and the ``swiftslurm`` console script.

``run`` is what every rank execs. Slurm's walltime USR2 (``--signal=USR2@grace``) reaches every process of a step,
and a step can start late in an allocation (an in-job restart, a rank of a requeued job): a USR2 during the ~1-2 s
of imports before the runtime's handler exists would kill the rank, since USR2's default action is to terminate,
and the job would end FAILED or TIMEOUT instead of being requeued. So ``run`` holds USR2 pending from its first
line; ``node.signals.install`` takes it over, and one that came meanwhile is then delivered to the handler.
"""

import sys

from .node.hold import hold_walltime_signal  # the standard library only

if sys.argv[1:2] == ["run"]:
    hold_walltime_signal()

from .cli import main  # noqa: E402  (after the signal is held: this import is the slow part)

if __name__ == "__main__":
    main()
