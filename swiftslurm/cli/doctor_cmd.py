"""`swiftslurm doctor TARGET [--json]`: the findings, most important first (exit 0 none, 6 some)."""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.markup import escape

from ..doctor import Finding, diagnose
from ..doctor.target import runs_of
from ..errors import FINDINGS_EXIT


def doctor_command(console: Console, target: str, as_json: bool) -> int:
    runs = runs_of(target)
    findings = diagnose(runs)
    recorded = _remember(findings, runs)
    if as_json:
        sys.stdout.write(json.dumps([f.to_json() for f in findings], indent=2) + "\n")
        return FINDINGS_EXIT if findings else 0
    if not findings:
        states = ", ".join(sorted({r.state for r in runs if r.state})) or "state unknown"
        console.print(f"[green]nothing wrong found[/] in {len(runs)} task(s) ({escape(states)}): logs, metrics, preflight "
                      "report and requeue records read", highlight=False)
        return 0
    many = len(runs) > 1
    console.print(f"[bold]{len(findings)} finding(s)[/], most important first:", highlight=False)
    for n, f in enumerate(findings, 1):
        print_finding(console, n, f, many)
    if recorded:
        from ..ledger import ledger_path

        console.print(f"\nrecorded {escape(', '.join(sorted({e.node for e in recorded})))} in the node-health ledger "
                      f"{escape(str(ledger_path()))}: the next submit excludes {'them' if len({e.node for e in recorded}) > 1 else 'it'} "
                      "(`swiftslurm nodes`; `swiftslurm nodes --clear NODE` once fixed)", highlight=False)
    return FINDINGS_EXIT


def _remember(findings: list[Finding], runs: list) -> list:
    """Record the nodes behind hangs and lost ranks in the ledger; a ledger that cannot be written is a note, not a failure."""
    from .. import ledger
    from ..doctor.remember import ledger_entries
    from ..errors import SwiftSlurmError

    entries = ledger_entries(findings, runs)
    if not entries:
        return []
    try:
        return ledger.record(entries)
    except (SwiftSlurmError, OSError) as exc:
        print(f"note: could not record the nodes in the node-health ledger: {exc}", file=sys.stderr)
        return []


def print_finding(console: Console, n: int, f: Finding, with_task: bool) -> None:
    task = f"task {f.task} " if with_task else ""
    console.print(f"\n[bold red]{n}. {f.code}[/] {escape(task)}{escape(f.what)}", highlight=False)
    for e in f.evidence:
        where = e.where()
        console.print(f"   [dim]evidence[/] {escape(where)}" + (f": {escape(e.text)}" if e.text else ""), highlight=False)
    console.print(f"   [yellow]cause[/] {escape(f.cause)}", highlight=False)
    console.print(f"   [green]fix[/] {escape(f.fix)}", highlight=False)
    if f.keys:
        console.print(f"   [dim]spec keys: {escape(', '.join(f.keys))}[/]", highlight=False)
