"""The node-health ledger: nodes that failed a preflight, hung a job or lost a rank, remembered across jobs.

``store`` reads and writes the ledger file (``~/.swiftslurm/ledger.json``, or ``$SWIFTSLURM_LEDGER``) under a
lock with atomic replaces, so ranks of many jobs and the CLI may write at once; ``avoid`` (pure) decides which
recently failed nodes a submission excludes, and which it cannot exclude without leaving the job unsatisfiable.
"""

from .apply import avoid_in_plan
from .avoid import Avoidance, avoid
from .store import LEDGER_ENV, Entry, clear, ledger_path, read, recent, record, valid_node_name

__all__ = ["avoid_in_plan", "Avoidance", "avoid", "LEDGER_ENV", "Entry", "clear", "ledger_path", "read", "recent", "record", "valid_node_name"]
