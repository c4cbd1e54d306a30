"""The sbatch script of a plan: ``render_sbatch(plan) -> str``, pure (no cluster, no disk writes).

``sbatch_directives(plan, group)`` is the one list of ``#SBATCH`` options; the submitit path
(``jobs/send.py``) sends the same list, so a hand-submitted ``sbatch FILE`` and ``swiftslurm submit``
ask Slurm for the same thing. Every user value reaches the script through ``quoting.shell_quote``.

A plan whose sweep spans several allocations (``plan.groups``) has one script per group; its
``--array`` lists the group's global task indices (``--array=1,3%2``), so ``SLURM_ARRAY_TASK_ID``
is the task index in every script. Where the site caps arrays (``plan.arrays(limits)`` splits a
group), each part's script lists indices ``task - offset`` and exports
``SWIFTSLURM_TASK=$((SLURM_ARRAY_TASK_ID + offset))``, the global task index the runtime reads.
"""

from __future__ import annotations

from pathlib import PurePosixPath

import jinja2

from ..errors import OneScriptTooFew, Problem, SpecError
from ..plan import ArrayLimits, ArrayPart, Group, Plan
from ..quoting import one_line, sbatch_directive, shell_quote
from ..resources import resource_dir
from ..spec.sbatch_options import parse_extra

TEMPLATE = "sbatch.sh.j2"

def _problem(path: str, what: str, found: str, hint: str) -> SpecError:
    return SpecError("spec", [Problem(path, what, found, hint)])


def extra_options(extra: list[str]) -> list[tuple[str, str | None]]:
    """``["--key=value", "--flag"]`` as (full option name, value|None), by the spec's own guard (``parse_extra``)."""
    out: list[tuple[str, str | None]] = []
    for opt in extra:
        try:
            out.append(parse_extra(opt))
        except ValueError as exc:
            raise _problem("slurm.extra_sbatch", str(exc), repr(opt), "see the spec reference in the README") from None
    return out


def one_group(plan: Plan, group: Group | None) -> Group:
    """``group``, or the plan's only group; a plan spanning several allocations needs one named."""
    if group is not None:
        return group
    if len(plan.groups) > 1:
        raise OneScriptTooFew(
            f"the sweep asks Slurm for {len(plan.groups)} different allocations, which one script cannot hold",
            "; ".join(f"tasks {index_ranges(g.tasks)}: {g.slurm.nodes} node(s) x {g.slurm.ranks_per_node} rank(s), time {g.slurm.time}"
                      for g in plan.groups[:4])
            + (" ..." if len(plan.groups) > 4 else ""),
            "`swiftslurm render SPEC -o FILE` writes one script per allocation (job.sh -> job.group0.sh, job.group1.sh, ...); `swiftslurm submit` "
            "sends one array each",
        )
    return plan.groups[0]


def index_ranges(indices: tuple[int, ...] | list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``0-2,5,7-8`` (Slurm's --array list syntax; pure)."""
    parts: list[str] = []
    start = prev = None
    for i in sorted(indices):
        if prev is not None and i == prev + 1:
            prev = i
            continue
        if start is not None:
            parts.append(f"{start}-{prev}" if prev != start else str(start))
        start = prev = i
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(parts)


def array_spec(plan: Plan, group: Group | None = None, part: ArrayPart | None = None) -> str | None:
    """``0-N%P`` for a sweep (one array task per combination, global indices), None for a single job.

    For one ``part`` of a split group: its indices less the part's offset (parallelism is per array).
    """
    if not plan.is_array:
        return None
    group = part.group if part is not None else one_group(plan, group)
    indices = part.array_indices if part is not None else group.tasks
    n = len(indices)
    parallel = min(group.slurm.array_parallelism or n, n)
    return f"{index_ranges(indices)}%{parallel}"


def sbatch_directives(plan: Plan, group: Group | None = None) -> list[tuple[str, str | None]]:
    """Every ``#SBATCH`` option both submit paths send for one group, as (key, value|None for a flag).

    Logs and ``--array`` are added by each path (submitit keeps its own log folder).
    """
    s = one_group(plan, group).slurm
    if "%" in plan.output_dir:
        raise _problem("job.output_dir", "'%' in the output dir would be read as a Slurm filename pattern", plan.output_dir, "choose a path without '%'")
    opts: list[tuple[str, str | None]] = [
        ("job-name", plan.spec.job.name),
        ("nodes", str(s.nodes + s.spare_nodes)),  # spares: allocated, used only when a restart replaces a node
        ("ntasks-per-node", str(s.ranks_per_node)),
        ("cpus-per-task", str(s.cpus_per_task)),
    ]
    if s.gpus_per_node:
        opts.append(("gpus-per-node", str(s.gpus_per_node)))
    if s.mem is not None:
        opts.append(("mem", s.mem))
    opts.append(("time", s.time))
    for key in ("partition", "account", "qos", "constraint", "exclude", "nodelist", "reservation"):
        value = getattr(s, key)
        if value is not None:
            opts.append((key, value))
    opts += [("signal", f"USR2@{s.signal_grace_s}"), ("requeue", None), ("open-mode", "append")]
    extra = extra_options(s.extra_sbatch)
    if s.max_restarts and not any(key == "no-kill" for key, _ in extra):  # a failed node must not end the allocation
        opts.append(("no-kill", None))
    opts += extra
    return opts


def log_pattern(plan: Plan) -> str:
    """Where the hand-submitted script's Slurm log goes (``%A_%a`` per array task).

    Slurm opens it before the script runs, so it lies in the output dir itself, which
    ``swiftslurm render -o`` creates when it writes the plan.
    """
    name = "slurm-%A_%a.out" if plan.is_array else "slurm-%j.out"
    return str(PurePosixPath(plan.output_dir) / name)


def _template() -> jinja2.Template:
    text = resource_dir("templates").joinpath(TEMPLATE).read_text("utf-8")
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    env.filters["q"] = shell_quote
    return env.from_string(text)


def render_all(plan: Plan, python: str | None = None, limits: ArrayLimits | None = None) -> list[str]:
    """One script per sbatch call (``plan.arrays(limits)``: per group, or per part of a split group), in order."""
    return [render_sbatch(plan, python, part=part) for part in plan.arrays(limits)]


def script_names(name: str, parts: list[ArrayPart]) -> list[str]:
    """File names for the scripts of ``parts`` (pure): ``job.sh``; or ``job.group1.sh``, ``job.part0.sh``,
    ``job.group1.part0.sh`` where there are several groups and/or split groups."""
    if len(parts) == 1:
        return [name]
    stem, dot, suffix = name.rpartition(".") if "." in name.lstrip(".") else (name, "", "")
    several_groups = len({p.group.index for p in parts}) > 1
    out = []
    for p in parts:
        label = (f".group{p.group.index}" if several_groups else "") + (f".part{p.part}" if p.parts > 1 else "")
        out.append(f"{stem}{label}{dot}{suffix}")
    return out


def render_sbatch(plan: Plan, python: str | None = None, group: Group | None = None, part: ArrayPart | None = None) -> str:
    """A standalone script that plain ``sbatch FILE`` runs: directives, env, USR2 trap, ``srun ... swiftslurm run``.

    ``python`` is the interpreter the nodes run when ``slurm.python`` is unset (default: this one, so the
    same installed swiftslurm; ``python3`` inside a container).
    The plan file (``plan.plan_path``) must exist when the job starts: ``swiftslurm render -o`` writes it.
    ``group``: which allocation; may be left out only when the plan has one (else a SpecError says so).
    ``part``: one part of a group split under array caps (``plan.arrays(limits)``); implies its group.
    """
    from .. import __version__
    from .launch import launch_for, passthrough_lines, supervisor_for

    group = part.group if part is not None else one_group(plan, group)
    opts = sbatch_directives(plan, group)
    opts.append(("output", log_pattern(plan)))
    array = array_spec(plan, group, part)
    if array:
        opts.append(("array", array))
    try:
        directives = [sbatch_directive(k, v) for k, v in opts]
        for key in plan.env:
            one_line(key, "an [env] name")
    except ValueError as exc:
        raise _problem("slurm", "a value cannot go on an #SBATCH line", str(exc), "remove the line break") from None
    launch = launch_for(plan, group, python)
    c = plan.container
    return _template().render(
        version=__version__,
        source=plan.source.replace("\n", " ").replace("\r", " "),
        directives=directives,
        env=plan.env,
        plan_path=plan.plan_path,
        is_array=plan.is_array,
        setup=list(group.slurm.setup),
        container=f"{c.runtime} {c.image}" if c is not None else "",
        passthrough=passthrough_lines(plan),
        srun_args=" ".join(shell_quote(a) for a in launch.srun_args),
        launch=launch.command(),
        task_offset=part.offset if part is not None else 0,
        cpus_per_task=group.slurm.cpus_per_task,
        supervisor=supervisor_for(plan, group, python),
    )
