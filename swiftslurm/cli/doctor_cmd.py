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
    return FINDINGS_EXIT


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
