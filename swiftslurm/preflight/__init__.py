"""The preflight: checks that name the bad node before a multi-node run wastes an hour.

``gate(dist, spec, output_dir, mode)`` is the entry point the runtime calls on every rank.
Checks return ``CheckResult``s; ``decide`` (pure) turns them into continue / warn / exclude / abort.
"""

from .gate import checks_for, gate
from .results import CheckResult, Decision, blamed_nodes, decide

__all__ = ["CheckResult", "Decision", "blamed_nodes", "checks_for", "decide", "gate"]
