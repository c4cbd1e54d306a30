"""The preflight report: a JSON file, a PNG of busbw against message size, and a rich table.

``build_report`` is pure (results in, dict out); ``write_report`` and ``plot_busbw`` write files;
``print_report`` prints. The JSON is what ``swiftslurm preflight --json`` hands to scripts.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

from ..fsutil import RECORD_CAP, atomic_write_bytes, atomic_write_text, read_json
from ..taskdir import PREFLIGHT_DIR as REPORT_DIR
from .results import CheckResult, Decision

REPORT_JSON = "report.json"
BUSBW_PNG = "busbw.png"


def build_report(results: list[CheckResult], decision: Decision, meta: dict[str, Any]) -> dict[str, Any]:
    sweep = next((r.data for r in results if r.check == "allreduce" and r.data.get("sizes")), None)
    return {
        "version": 1,
        **meta,
        "ok": not any(r.blocking for r in results),
        "failed": sum(r.blocking for r in results),
        "warnings": sum(r.warn_only and not r.ok for r in results),
        "decision": decision.to_json(),
        "results": [r.to_json() for r in results],
        "busbw": sweep,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def failure_of(report: dict[str, Any]) -> tuple[str, str] | None:
    """Why a report's decision stops training, as (what, hint) for one line (pure); None when it trains on.

    The first failed check with its node, what was seen and its fix (``ports localhost: 'nc' not found on PATH``,
    "install netcat ..."), the count of the others; without a failed check (an exclusion, a requeue refused),
    the decision's own reason."""
    decision = found if isinstance(found := report.get("decision"), dict) else {}
    if decision.get("proceed", True) is not False:
        return None
    results = listed if isinstance(listed := report.get("results"), list) else []
    bad = [r for r in results if isinstance(r, dict) and r.get("ok") is False and not r.get("warn_only")]
    reason = str(decision.get("reason") or "")
    if decision.get("action") == "exclude" or not bad:
        return f"preflight: {reason or 'no training (see preflight/report.json)'}", ""
    first = bad[0]
    more = f" (and {len(bad) - 1} more failed check(s): preflight/report.json)" if len(bad) > 1 else ""
    return f"preflight: {first.get('check', '?')} {first.get('node', '?')}: {first.get('observed', '')}{more}", str(first.get("hint") or "")


def write_report(output_dir: str | Path, report: dict[str, Any]) -> Path:
    """``<output_dir>/preflight/report.json`` (atomic) and ``busbw.png`` when an all-reduce ran."""
    folder = Path(output_dir) / REPORT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / REPORT_JSON
    atomic_write_text(path, json.dumps(report, indent=2))
    if report.get("busbw"):
        label = f"job {report.get('job_id', '?')}: {report['busbw'].get('world_size', '?')} ranks, {report['busbw'].get('backend', '')}"
        plot_busbw([(label, report["busbw"]["sizes"], report["busbw"]["busbw_gbps"])], folder / BUSBW_PNG)
    return path


def read_report(path: str | Path) -> dict[str, Any] | None:
    """A preflight report, or None when it is missing or unreadable (damaged, over its cap, not a regular file)."""
    try:
        return read_json(path, RECORD_CAP)
    except (OSError, ValueError):
        return None


def plot_busbw(runs: list[tuple[str, list[int], list[float]]], path: str | Path) -> Path:
    """One line per run: busbw (GB/s) against message size (log2 axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, sizes, busbw in runs:
        ax.plot(sizes, busbw, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title("all-reduce bus bandwidth (nccl-tests convention)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    atomic_write_bytes(Path(path), png.getvalue())  # never through a link someone left under the name
    return Path(path)


def results_table(results: list[dict[str, Any]], title: str = "preflight") -> Any:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title, show_lines=False, highlight=False)
    for col, style in (("check", "bold"), ("node", ""), ("", ""), ("observed", ""), ("expected", "dim"), ("hint", "yellow")):
        table.add_column(col, style=style or None, overflow="fold")
    for r in results:
        mark = "[green]ok[/]" if r["ok"] else "[yellow]WARN[/]" if r.get("warn_only") else "[bold red]FAIL[/]"
        cells = (r["check"], r["node"], r["observed"], r.get("expected", ""), r.get("hint", "") if not r["ok"] else "")
        check, node, observed, expected, hint = (escape(str(c)) for c in cells)
        table.add_row(check, node, mark, observed, expected, hint)
    return table


def print_report(console: Any, report: dict[str, Any], title: str | None = None) -> None:
    from rich.markup import escape

    console.print(results_table(report["results"], title or f"preflight: {', '.join(report.get('nodes', []))}"))
    d = report.get("decision", {})
    colour = "green" if report.get("ok") else "red"
    verdict = "all checks passed" if report.get("ok") else f"{report.get('failed')} check(s) failed"
    if report.get("warnings"):
        verdict += f", {report['warnings']} warning(s)"
    console.print(f"[{colour}]{verdict}[/]"
                  f" - decision: {escape(d.get('action', '?'))}: {escape(d.get('reason', ''))}", highlight=False)
    if report.get("wall_s") is not None:
        console.print(f"preflight wall time {report['wall_s']:.1f} s", highlight=False)
