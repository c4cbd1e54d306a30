"""Rich display of a Plan for `swiftslurm plan` (text mode)."""

from __future__ import annotations

import json

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from ..plan import Plan


def groups_table(plan: Plan) -> Table:
    """One row per allocation group: each is one sbatch array (one submission call)."""
    from ..slurm.render import index_ranges

    table = Table(title=f"{len(plan.groups)} allocation(s): one sbatch {'array' if plan.is_array else 'job'} each")
    for col in ("group", "tasks", "nodes x ranks", "gpus/node", "time", "partition", "max requeues"):
        table.add_column(col, overflow="fold")
    for g in plan.groups:
        s = g.slurm
        table.add_row(str(g.index), index_ranges(g.tasks), f"{s.nodes} x {s.ranks_per_node} = {g.world_size}", str(s.gpus_per_node or "-"),
                      escape(s.time), escape(s.partition or "-"), str(s.max_requeues))
    return table


def print_plan(console: Console, plan: Plan, sbatch: str | list[str]) -> None:
    scripts = [sbatch] if isinstance(sbatch, str) else sbatch
    spec = plan.spec
    s = spec.slurm
    console.print(
        Panel.fit(
            Text.from_markup(
            f"[bold]{escape(spec.job.name)}[/]  from {escape(plan.source)}\n"
            f"{s.nodes} node(s) x {s.ranks_per_node} rank(s) = world size {spec.world_size}"
            f"{f', {s.gpus_per_node} GPU(s)/node' if s.gpus_per_node else ' (CPU)'}, time {s.time}, "
            f"USR2 {s.signal_grace_s} s before the limit, up to {s.max_requeues} requeues\n"
            f"plan file: {escape(plan.plan_path)}",
            overflow="fold"),
            title="swiftslurm plan",
        ),
        soft_wrap=False,  # wrap inside the panel, never crop a path
    )
    several = len(plan.groups) > 1
    if several:
        console.print(groups_table(plan))
    table = Table(title=f"{len(plan.tasks)} task(s)" + ((" in " + str(len(plan.groups)) + " sbatch arrays" if several else " (one sbatch array)") if plan.is_array else ""))
    table.add_column("task", justify="right")
    table.add_column("overrides")
    table.add_column("output dir", overflow="fold")
    table.add_column("train")
    for t in plan.tasks:
        tr = t.spec.train
        what = " ".join(tr.command) if tr.command else f"{tr.train_type} {tr.model} ds={tr.deepspeed}"
        overrides = ", ".join(f"{k}={v}" for k, v in t.overrides.items()) or "-"
        table.add_row(str(t.index), Text(overrides), Text(t.output_dir), Text(what))  # Text: user strings, not markup
    console.print(table)
    if plan.deepspeed and plan.deepspeed[0] is not None:
        console.print("[bold]DeepSpeed config (task 0):[/]")
        console.print(Syntax(json.dumps(plan.deepspeed[0], indent=2), "json"))
    if plan.env:
        console.print("[bold]environment on every node:[/] " + escape(", ".join(f"{k}={v}" for k, v in plan.env.items())), highlight=False)
    for w in plan.warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}", highlight=False)
    for group, script in zip(plan.groups, scripts):
        which = f" of group {group.index} (tasks {', '.join(map(str, group.tasks[:16]))}{' ...' if len(group.tasks) > 16 else ''})" if several else ""
        console.print(f"[bold]sbatch script{which} (swiftslurm render):[/]")
        console.print(Syntax(script, "bash"))
