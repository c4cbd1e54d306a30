"""`swiftslurm nodes [--json] [--clear NODE ...] [--clear-all]`: the node-health ledger, and forgetting nodes."""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime, timezone

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .. import ledger
from ..errors import SwiftSlurmError


def _when(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _ago(seconds: float) -> str:
    hours = seconds / 3600.0
    return f"{seconds / 60:.0f} min ago" if hours < 1 else f"{hours:.1f} h ago" if hours < 48 else f"{hours / 24:.0f} d ago"


def nodes_command(console: Console, as_json: bool, clear: list[str], clear_all: bool) -> int:
    path = ledger.ledger_path()
    if clear and clear_all:
        raise SwiftSlurmError("--clear and --clear-all do not go together", f"--clear {' '.join(clear)} --clear-all",
                              "give --clear NODE (repeatable) to forget some nodes, or --clear-all for every one")
    if clear or clear_all:
        if clear:
            known = {e.node for e in ledger.read(path)}
            unknown = [n for n in clear if n not in known]
            if unknown:
                raise SwiftSlurmError(f"the ledger has no entry for {', '.join(unknown)}",
                                      f"nodes in {path}: {', '.join(sorted(known)) or 'none'}", "check the name with `swiftslurm nodes`")
        removed = ledger.clear(None if clear_all else clear, path)
        names = sorted({e.node for e in removed})
        console.print(f"forgot {len(removed)} entr{'y' if len(removed) == 1 else 'ies'}" + (f" of {escape(', '.join(names))}" if names else "")
                      + f" in {escape(str(path))}", highlight=False)
        return 0
    dropped: list[str] = []
    entries = sorted(ledger.read(path, dropped), key=lambda e: (e.node, -e.when))
    if as_json:
        sys.stdout.write(json.dumps({"ledger": str(path), "entries": [e.to_json() for e in entries], "dropped": dropped}, indent=2) + "\n")
        return 0
    for why in dropped:
        console.print(f"[yellow]left out[/] of {escape(str(path))}: {escape(why)} (the next change to the ledger drops it)", highlight=False)
    if not entries:
        console.print(f"the node-health ledger {escape(str(path))} is empty: no node failed a preflight, hung or lost a rank", highlight=False)
        return 0
    now = time.time()
    table = Table(title=f"node-health ledger ({escape(str(path))})")
    for col in ("node", "reason", "job", "when", "what was seen"):
        table.add_column(col, overflow="fold")
    for e in entries:
        table.add_row(escape(e.node), escape(e.reason), escape(e.job or "-"), f"{_when(e.when)} ({_ago(now - e.when)})", escape(e.detail))
    console.print(table)
    console.print("submit excludes a node failed within slurm.bad_node_ttl_h (24 h by default; slurm.avoid_bad_nodes = false "
                  "turns it off); forget one with `swiftslurm nodes --clear NODE`", highlight=False)
    return 0
