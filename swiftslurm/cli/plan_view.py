"""Rich display of a Plan for `swiftslurm plan` (text mode)."""

from __future__ import annotations

import json

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from ..plan import ArrayLimits, Plan
from ..sizing.vision import ImagePlan


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


def site_rows(plan: Plan, limits: ArrayLimits | None) -> list[tuple[str, str]]:
    """The site environment a plan asks for, as (label, value) rows (pure): setup, python, container, array split."""
    from ..slurm.launch import launch_for, mounts_of
    from ..slurm.render import index_ranges

    rows: list[tuple[str, str]] = []
    group = plan.groups[0]
    if group.slurm.setup:
        rows.append(("setup lines", "\n".join(group.slurm.setup)))
    rows.append(("python on the nodes", launch_for(plan, group).python + ("" if group.slurm.python else " (default)")))
    c = plan.container
    if c is not None:
        rows.append(("container", f"{c.runtime} {c.image}" + (f", workdir {c.workdir}" if c.workdir else "") + (", writable" if c.writable else "")))
        rows.append(("mounts", ", ".join(mounts_of(plan))))
        if c.env:
            rows.append(("env into the container", ", ".join(c.env)))
    if plan.is_array:
        parts = plan.arrays(limits)
        if limits is None or not limits.known:
            rows.append(("array split", "split at submit if the site caps arrays (MaxArraySize; `--max-array-size N` shows it)"))
        elif len(parts) == len(plan.groups):
            rows.append(("array split", f"none needed ({limits.describe()})"))
        else:
            rows.append(("array split", f"{len(parts)} arrays ({limits.describe()}): "
                         + "; ".join(f"tasks {index_ranges(p.tasks)}" + (f" (index + {p.offset})" if p.offset else "") for p in parts)))
    return rows


def sizing_table(plan: Plan) -> Table | None:
    """Task 0's parallel layout and per-rank GPU memory estimate (the JSON has every task's)."""
    sizing = plan.sizing[0] if plan.sizing else None
    if sizing is None:
        return None
    lay = sizing.layout
    table = Table(title="parallel layout and GPU memory per rank (estimate" + (", task 0)" if len(plan.tasks) > 1 else ")"),
                  show_header=False, title_justify="left")
    table.add_column(style="bold cyan")
    table.add_column(overflow="fold")
    table.add_row("ranks", f"{lay.data_parallel} data x {lay.sequence_parallel} sequence x {lay.tensor_parallel} tensor parallel "
                  f"= world size {lay.world_size}" + (f"; experts split over groups of {lay.expert_parallel} data-parallel ranks "
                                                      "(AutoEP)" if lay.expert_parallel > 1 else ""))
    table.add_row("global batch", f"{lay.micro_batch} per rank x {lay.grad_accum} accumulation x {lay.data_parallel} data-parallel "
                  f"= {lay.global_batch} {'rows' if plan.tasks[0].spec.train.packing else 'samples'} per step")
    m = sizing.memory
    if sizing.checkpointing is not None:
        table.add_row("gradient checkpointing", Text(sizing.checkpointing.why))
    if sizing.shape is not None:
        sh = sizing.shape
        table.add_row("model shape", Text(f"{sh.total_params / 1e9:.3g}B params: hidden {sh.hidden_size}, {sh.num_layers} layers, "
                                          f"{sh.num_heads} heads / {sh.num_kv_heads} KV, vocab {sh.vocab_size} ({sh.source})"))
        if sh.is_moe:
            table.add_row("experts", Text(f"{sh.total_params / 1e9:.3g}B total, {sh.active_params / 1e9:.3g}B active per token: "
                                          f"{sh.num_experts} experts of width {sh.expert_width}, top-{sh.experts_per_token}, in "
                                          f"{sh.moe_layers} of {sh.num_layers} layers ({sh.routed_expert_params / 1e9:.3g}B in routed "
                                          "experts); weights and optimizer states count the total, activations the active"))
    if m is not None:
        gib = lambda b: f"{b / (1 << 30):.2f} GiB"  # noqa: E731
        labels = {"weights": "weights", "gradients_optimizer": "gradients + optimizer", "activations": "activations",
                  "logits_loss": "logits + loss", "overhead": "CUDA, NCCL, fragmentation",
                  "reference_model": "reference model (GRPO KL)", "generation_kv_cache": "generation KV cache (GRPO)",
                  "step_reuses_activations": "fp32 grads reuse freed memory",
                  "moe_dispatch": "MoE routing / all-to-all buffers"}
        for name, value in m.parts.items():
            table.add_row(labels.get(name, name), gib(value))
        verdict = "[green]fits[/]" if m.fits else "[bold red]does not fit[/]"
        table.add_row("total", Text.from_markup(f"{gib(m.total_bytes)} of {gib(m.gpu_memory_bytes)} (slurm.gpu_memory_gb): {verdict}"))
        if m.cpu_bytes_per_node:
            table.add_row("host memory (offload)", f"{gib(m.cpu_bytes_per_node)} per node")
        if m.checkpoint_bytes_per_node:
            table.add_row("a checkpoint", f"{gib(m.checkpoint_bytes_per_node)} per node (an async save stages it in host memory)")
    for line in sizing.advice:
        table.add_row("fits too" if m is not None and m.fits else "would fit", Text(line))
    for note in sizing.notes:
        table.add_row("note", Text(note))
    return table


def avoided_lines(avoided: list[dict], plan: Plan) -> list[str]:
    """What the node-health ledger changed (markup): the nodes excluded, the ones it could not exclude and why."""
    from ..slurm.render import index_ranges

    out = []
    for item in avoided:
        prefix = f"tasks {index_ranges(plan.groups[item['group']].tasks)}: " if len(plan.groups) > 1 else ""
        for note in item.get("notes", []):
            out.append(f"[yellow]bad nodes:[/]   {escape(prefix + note)}")
        if item.get("excluded"):
            out.append(f"             --exclude={escape(str(item.get('exclude')))}  (the ledger: swiftslurm nodes; slurm.avoid_bad_nodes = false to keep them)")
    return out


def images_table(plan: Plan, images: dict[int, ImagePlan]) -> Table | None:
    """Task 0's images (the first task with some; the JSON has every task's): tokens per image and their memory."""
    if not images:
        return None
    index = min(images)
    title = "images and the memory they imply (estimate" + (f", task {index})" if len(plan.tasks) > 1 else ")")
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column(style="bold cyan")
    table.add_column(overflow="fold")
    for label, value in images[index].rows():
        table.add_row(label, Text(value))
    return table


def print_plan(console: Console, plan: Plan, sbatch: str | list[str], limits: ArrayLimits | None = None,
               avoided: list[dict] | None = None, images: dict[int, ImagePlan] | None = None) -> None:
    scripts = [sbatch] if isinstance(sbatch, str) else sbatch
    spec = plan.spec
    s = spec.slurm
    console.print(
        Panel.fit(
            Text.from_markup(
            f"[bold]{escape(spec.job.name)}[/]  from {escape(plan.source)}\n"
            f"{s.nodes} node(s) x {s.ranks_per_node} rank(s) = world size {spec.world_size}"
            f"{f', {s.gpus_per_node} GPU(s)/node' if s.gpus_per_node else ' (CPU)'}, time {s.time}, "
            f"USR2 {s.signal_grace_s} s before the limit, up to {s.max_requeues} requeues"
            + (f"; up to {s.max_restarts} in-job restart(s)" + (f", {s.spare_nodes} spare node(s) allocated" if s.spare_nodes else "")
               + (", shrinks on failure" if s.shrink_on_failure else "") if s.max_restarts else "") + "\n"
            f"plan file: {escape(plan.plan_path)}",
            overflow="fold"),
            title="swiftslurm plan",
        ),
        soft_wrap=False,  # wrap inside the panel, never crop a path
    )
    several = len(plan.groups) > 1
    if several:
        console.print(groups_table(plan))
    arrays = (" in " + str(len(plan.groups)) + " sbatch arrays" if several else " (one sbatch array)") if plan.is_array else ""
    table = Table(title=f"{len(plan.tasks)} task(s)" + arrays)
    table.add_column("task", justify="right")
    table.add_column("overrides")
    table.add_column("output dir", overflow="fold")
    table.add_column("train")
    for t in plan.tasks:
        tr = t.spec.train
        what = " ".join(tr.command) if tr.command else f"{tr.train_type} {tr.model} ds={tr.deepspeed}"
        what = what if t.spec.has_training else "- (no [train]: preflight only)"
        overrides = ", ".join(f"{k}={v}" for k, v in t.overrides.items()) or "-"
        table.add_row(str(t.index), Text(overrides), Text(t.output_dir), Text(what))  # Text: user strings, not markup
    console.print(table)
    if plan.deepspeed and plan.deepspeed[0] is not None:
        console.print("[bold]DeepSpeed config (task 0):[/]")
        console.print(Syntax(json.dumps(plan.deepspeed[0], indent=2), "json"))
    sizing = sizing_table(plan)
    if sizing is not None:
        console.print(sizing)
    shown = images_table(plan, images or {})
    if shown is not None:
        console.print(shown)
    if plan.env:
        console.print("[bold]environment on every node:[/] " + escape(", ".join(f"{k}={v}" for k, v in plan.env.items())), highlight=False)
    site = Table(title="site environment", show_header=False, title_justify="left")
    site.add_column(style="bold cyan")
    site.add_column(overflow="fold")
    for label, value in site_rows(plan, limits):
        site.add_row(label, Text(value))  # user text: no markup
    console.print(site)
    for w in plan.warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}", highlight=False)
    for line in avoided_lines(avoided or [], plan):  # what submit would exclude now, from the ledger
        console.print(line, highlight=False, soft_wrap=True)
    parts = plan.arrays(limits)
    for part, script in zip(parts, scripts, strict=True):
        group = part.group
        tasks = f"tasks {', '.join(map(str, part.tasks[:16]))}{' ...' if len(part.tasks) > 16 else ''}"
        which = (f" of group {group.index}" if several else "") + (f" part {part.part} ({tasks})" if part.parts > 1 else (f" ({tasks})" if several else ""))
        console.print(f"[bold]sbatch script{which} (swiftslurm render):[/]")
        console.print(Syntax(script, "bash"))
