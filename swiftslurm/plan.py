"""Build, then send: ``make_plan`` is pure and complete; submitting only sends what it returns.

A Plan holds the resolved spec of every array task (one per sweep combination), the merged
DeepSpeed config of each, the environment exported on every node, and the sbatch script that
``swiftslurm render`` writes. ``swiftslurm plan`` prints exactly this.

Tasks are grouped by the allocation they ask Slurm for (their ``[slurm]`` table): a sweep over
``slurm.nodes`` or ``slurm.time`` gives several groups, each sent as its own sbatch array. Task
indices (and task dirs ``output_dir/<index>``) stay global across groups.

A site may cap job arrays (``MaxArraySize``: indices below it; ``max_array_tasks``: tasks per array).
``Plan.arrays(limits)`` splits each group into parts that fit (pure: the caller passes the limits it
read from the cluster); each part is one sbatch call, and a part's array index + ``offset`` is the
global task index.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path, PurePosixPath
from typing import Any

from .errors import Problem, SpecError
from .sizing.check import Sizing, resolve_async_save, size_task
from .spec.load import NO_TRAIN_NOTE, JobSpec, _sweep_overrides, apply_overrides, check_files, validate_spec
from .spec.model import SlurmTable, is_local_image
from .taskdir import PLAN_FILE


@dataclass(frozen=True)
class Task:
    index: int
    overrides: dict[str, Any]
    output_dir: str  # absolute
    spec: JobSpec
    decisions: dict[str, str] = field(default_factory=dict)  # what plan resolved from "auto" (key -> why), for the banner

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "overrides": self.overrides,
            "output_dir": self.output_dir,
            "spec": self.spec.model_dump(mode="json"),
            "decisions": self.decisions,
        }


@dataclass(frozen=True)
class Group:
    """Tasks that share one allocation: one sbatch array (one submission call) per group."""

    index: int
    tasks: tuple[int, ...]  # global task indices, ascending
    slurm: SlurmTable  # the [slurm] table every task of the group resolved to

    @property
    def world_size(self) -> int:
        return self.slurm.nodes * self.slurm.ranks_per_node

    def to_json(self) -> dict[str, Any]:
        s = self.slurm
        return {
            "index": self.index,
            "tasks": list(self.tasks),
            "nodes": s.nodes,
            "tasks_per_node": s.ranks_per_node,
            "world_size": self.world_size,
            "time": s.time,
            "slurm": s.model_dump(mode="json"),
        }


@dataclass(frozen=True)
class ArrayLimits:
    """A site's caps on job arrays (``scontrol show config``); None = no cap known."""

    max_array_size: int | None = None  # MaxArraySize: every array index must be below it
    max_array_tasks: int | None = None  # SchedulerParameters max_array_tasks: tasks in one array

    @property
    def known(self) -> bool:
        return self.max_array_size is not None or self.max_array_tasks is not None

    def describe(self) -> str:
        parts = [f"MaxArraySize={self.max_array_size}" if self.max_array_size is not None else "",
                 f"max_array_tasks={self.max_array_tasks}" if self.max_array_tasks is not None else ""]
        return ", ".join(p for p in parts if p) or "no cap"


@dataclass(frozen=True)
class ArrayPart:
    """One sbatch call: some tasks of a group. Slurm array index = global task index - ``offset``."""

    group: Group
    part: int  # 0.. within the group
    parts: int  # how many parts the group was split into
    tasks: tuple[int, ...]  # global task indices, ascending
    offset: int  # 0 unless the group was split

    @property
    def array_indices(self) -> tuple[int, ...]:
        return tuple(t - self.offset for t in self.tasks)

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group.index, "part": self.part, "tasks": list(self.tasks), "task_offset": self.offset}


def split_tasks(tasks: tuple[int, ...], limits: ArrayLimits) -> list[tuple[tuple[int, ...], int]]:
    """``tasks`` as (tasks, offset) parts that fit ``limits`` (pure).

    Unsplit (offset 0) when the global indices already fit; else greedy parts, each starting at its
    first task (offset), holding tasks while ``task - offset < max_array_size`` and at most
    ``max_array_tasks`` of them.
    """
    size, count = limits.max_array_size, limits.max_array_tasks
    if (size is not None and size < 1) or (count is not None and count < 1):
        raise ValueError(f"job arrays are disabled here ({limits.describe()})")
    if (size is None or max(tasks) < size) and (count is None or len(tasks) <= count):
        return [(tasks, 0)]
    parts: list[tuple[tuple[int, ...], int]] = []
    current: list[int] = []
    for t in tasks:
        if current and ((size is not None and t - current[0] >= size) or (count is not None and len(current) >= count)):
            parts.append((tuple(current), current[0]))
            current = []
        current.append(t)
    parts.append((tuple(current), current[0]))
    return parts


def group_tasks(tasks: list[Task]) -> list[Group]:
    """Tasks by distinct ``[slurm]`` table, in order of first appearance (pure).

    Every slurm key may change what is sent (sbatch options, the signal, submitit's requeue count),
    so two tasks share an array only when their whole table is equal.
    """
    by_key: dict[str, list[Task]] = {}
    for task in tasks:
        by_key.setdefault(json.dumps(task.spec.slurm.model_dump(mode="json"), sort_keys=True), []).append(task)
    return [Group(i, tuple(t.index for t in members), members[0].spec.slurm) for i, members in enumerate(by_key.values())]


@dataclass(frozen=True)
class Plan:
    source: str
    spec: JobSpec
    base_dir: str  # directory relative paths are resolved against (the submitting cwd)
    output_dir: str  # absolute job.output_dir: the plan, submission records and (with a sweep) task dirs
    tasks: list[Task]
    deepspeed: list[dict[str, Any] | None]  # per task; None when train.command runs a user script
    warnings: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    sizing: list[Sizing | None] = field(default_factory=list)  # per task: layout, model shape, memory estimate

    @cached_property
    def groups(self) -> list[Group]:
        """One group per distinct allocation; a plan without an allocation sweep has exactly one."""
        return group_tasks(self.tasks)

    @property
    def is_array(self) -> bool:
        return bool(self.spec.sweep)

    @property
    def container(self):
        """The ``[container]`` table with paths resolved (not sweepable: every task has the same), or None."""
        return self.tasks[0].spec.container if self.tasks else self.spec.container

    def arrays(self, limits: ArrayLimits | None = None) -> list[ArrayPart]:
        """Every sbatch call, in order: one per group, or several where ``limits`` cap arrays (pure).

        A plan without a sweep is one job per group (no array), never split.
        """
        out: list[ArrayPart] = []
        for g in self.groups:
            parts = split_tasks(g.tasks, limits) if self.is_array and limits is not None else [(g.tasks, 0)]
            out += [ArrayPart(g, i, len(parts), tasks, offset) for i, (tasks, offset) in enumerate(parts)]
        return out

    @property
    def plan_path(self) -> str:
        return str(PurePosixPath(self.output_dir) / PLAN_FILE)

    def to_json(self, sbatch: str | list[str] | None = None, limits: ArrayLimits | None = None) -> dict[str, Any]:
        """The plan as JSON. ``sbatch``: the script (one array) or one script per ``arrays(limits)`` part.

        ``sbatch`` at the top level is the script when there is one, else null; each group carries
        its script under ``groups[i].sbatch`` (null when split), and ``arrays`` lists every sbatch
        call (group, part, tasks, task_offset, and its script).
        """
        groups = [g.to_json() for g in self.groups]
        parts = self.arrays(limits)
        scripts = [sbatch] if isinstance(sbatch, str) else sbatch
        arrays = [p.to_json() for p in parts]
        if scripts is not None:
            for entry, script in zip(arrays, scripts, strict=True):
                entry["sbatch"] = script
            for entry in groups:
                mine = [a for a in arrays if a["group"] == entry["index"]]
                entry["sbatch"] = mine[0].get("sbatch") if len(mine) == 1 else None
        out: dict[str, Any] = {
            "source": self.source,
            "base_dir": self.base_dir,
            "output_dir": self.output_dir,
            "plan_path": self.plan_path,
            "array": self.is_array,
            "nodes": self.spec.slurm.nodes,
            "tasks_per_node": self.spec.slurm.ranks_per_node,
            "world_size": self.spec.world_size,
            "spec": self.spec.model_dump(mode="json"),
            "tasks": [t.to_json() for t in self.tasks],
            "groups": groups,
            "arrays": arrays,
            "array_limits": None if limits is None else {"max_array_size": limits.max_array_size, "max_array_tasks": limits.max_array_tasks},
            "deepspeed": self.deepspeed,
            "memory": [s.to_json() if s is not None else None for s in self.sizing],
            "env": self.env,
            "warnings": self.warnings,
        }
        if scripts is not None:
            out["sbatch"] = scripts[0] if len(scripts) == 1 else None
        return out


def _absolute(path: str, base: str) -> str:
    p = PurePosixPath(path)
    return str(p if p.is_absolute() else PurePosixPath(base) / p)


SECRET_NAME = re.compile(r"API_?KEY|TOKEN|SECRET|PASSW(OR)?D|CREDENTIAL|PRIVATE_KEY", re.I)


def advice(spec: JobSpec) -> list[str]:
    """What is valid but most likely not what the user meant (pure, over a task's resolved spec): ``validate`` and
    ``plan`` show them as warnings."""
    out = []
    secrets = sorted(k for k in spec.env if SECRET_NAME.search(k))
    if secrets:
        out.append(f"[env] {', '.join(secrets)} look(s) like a secret: [env] is written into the rendered batch script and the "
                   "resolved spec in the output dir (spec.json, swiftslurm-plan.json), readable by whoever can read them; export it "
                   "in the shell you submit from instead (sbatch passes your environment on) and drop it from the spec")
    train = spec.train
    same = [d for d in train.eval_dataset if os.path.normpath(d) in {os.path.normpath(t) for t in train.dataset}]
    if same:
        out.append(f"train.eval_dataset names training data ({', '.join(same)}): eval_loss then measures how well the run "
                   "remembers what it trained on, not how it does on new records; hold some out with train.eval_split, or "
                   "evaluate on another file")
    return out


def _resolve_paths(spec: JobSpec, base_dir: str, spec_dir: str | None = None) -> JobSpec:
    """Relative dataset / deepspeed / model / resume_from paths become absolute, so every node sees the same files;
    a reward function's ``file.py:function`` is found next to the spec (``spec_dir``)."""
    from .spec.grpo_rules import resolve_reward_file

    train = spec.train
    updates: dict[str, Any] = {"dataset": [_absolute(d, base_dir) for d in train.dataset],
                               "eval_dataset": [_absolute(d, base_dir) for d in train.eval_dataset]}
    if train.reward_funcs:
        updates["reward_funcs"] = [resolve_reward_file(r, spec_dir or base_dir) for r in train.reward_funcs]
    if train.deepspeed.endswith(".json") or "/" in train.deepspeed:
        updates["deepspeed"] = _absolute(train.deepspeed, base_dir)
    if train.model and train.model.startswith("."):
        updates["model"] = _absolute(train.model, base_dir)
    if train.resume_from is not None:
        updates["resume_from"] = _absolute(train.resume_from, base_dir)
    out = spec.model_copy(update={"train": train.model_copy(update=updates)})
    c = spec.container
    if c is not None:  # a relative local image or mount source means the same file on every node
        image = _absolute(c.image, base_dir) if is_local_image(c.image) else c.image
        mounts = [m if m.startswith("/") else _absolute(m, base_dir) for m in c.mounts]
        out = out.model_copy(update={"container": c.model_copy(update={"image": image, "mounts": mounts})})
    return out


def _inside(root: str, path: str, check_disk: bool) -> bool:
    """``path`` is ``root`` or lies under it: by name (``..`` folded), and with ``check_disk`` by the real paths too."""
    from .fsutil import is_inside

    r, p = PurePosixPath(os.path.normpath(root)), PurePosixPath(os.path.normpath(path))
    return p == r or r in p.parents or (check_disk and is_inside(root, path))


def _resume_from_problems(spec: JobSpec, output_dir: str, task_out: str, check_disk: bool) -> list[Problem]:
    """``train.resume_from`` may not be the run's own output dir (or a task's, or anything under them): the run
    would start from the checkpoints it is about to write, and import it into its own ``resume-source/``."""
    source = spec.train.resume_from
    if source is None:
        return []
    for root, what in ((task_out, "this task's output dir"), (output_dir, "the job's output dir")):
        if _inside(root, source, check_disk):
            return [Problem("train.resume_from", f"resume_from is {what} or inside it: a run resumes from its own checkpoints "
                            "by itself (requeues do), and resume_from names another run's checkpoint to start from",
                            f"resume_from {source}, output dir {root}",
                            "drop resume_from to continue this run, or give the new run its own job.output_dir")]
    return []


MAX_LISTED_TASKS = 5  # failing sweep tasks whose problems are listed one by one


def _task_problems(index: int, overrides: dict[str, Any], problems: list[Problem]) -> list[Problem]:
    """A task's problems, labelled with its sweep combination when there is one."""
    if not overrides:
        return problems
    return [Problem(p.path, f"{p.what} (sweep task {index}: {overrides})", p.found, p.hint, p.line) for p in problems]


def _raise_collected(source: str, failing: list[list[Problem]], total: int) -> None:
    if not failing:
        return
    problems = [p for task in failing[:MAX_LISTED_TASKS] for p in task]
    if len(failing) > MAX_LISTED_TASKS:
        problems.append(Problem("sweep", f"{len(failing)} of {total} sweep tasks have problems; the first {MAX_LISTED_TASKS} are listed",
                                hint="fix the keys above and re-run `swiftslurm validate`"))
    raise SpecError(source, problems)


def make_plan(spec: JobSpec, raw: dict[str, Any], base_dir: str, source: str = "spec", check_disk: bool = False) -> Plan:
    """Everything submit would do, as values. No cluster, no environment; reads only a user DeepSpeed JSON.

    ``raw`` is the spec's TOML dict (sweep overrides are applied to it and re-validated);
    ``base_dir`` is the absolute directory relative paths are resolved against. With ``check_disk`` the
    disk-facing checks (``spec.check_files``: datasets, a local model dir, a user DeepSpeed JSON) run for
    every task too, since a sweep may name other files. Every task is planned, and the problems of every
    failing task (the first few of a big sweep) are raised together as one SpecError.
    """
    from . import dsconfig

    output_dir = _absolute(spec.job.output_dir, base_dir)
    combos = _sweep_overrides(spec.sweep) if spec.sweep else [{}]
    tasks: list[Task] = []
    ds_configs: list[dict[str, Any] | None] = []
    sizings: list[Sizing | None] = []
    warnings: list[str] = []
    failing: list[list[Problem]] = []
    checked: set[str] = set()
    for index, overrides in enumerate(combos):
        problems: list[Problem] = []
        try:
            task_spec = validate_spec(apply_overrides(raw, overrides), source) if overrides else spec
        except SpecError as exc:
            failing.append(_task_problems(index, overrides, exc.problems))
            continue
        files_key = task_spec.train.model_dump_json(include={"dataset", "eval_dataset", "model", "deepspeed"})
        if check_disk and files_key not in checked:
            checked.add(files_key)
            try:
                check_files(task_spec, Path(base_dir), source)
            except SpecError as exc:
                problems += exc.problems
        task_spec = _resolve_paths(task_spec, base_dir, os.path.normpath(_absolute(os.path.dirname(source) or ".", base_dir)))
        ds: dict[str, Any] | None = None
        warns: list[str] = []
        if task_spec.has_training and not task_spec.train.command:  # no [train]: no DeepSpeed either
            try:
                ds, warns = dsconfig.build_for_spec(task_spec)
            except SpecError as exc:
                problems += [p for p in exc.problems if (p.path, p.what) not in {(q.path, q.what) for q in problems}]
        sizing = None
        if ds is not None:  # the parallel rules and the memory estimate (a local config.json is read with check_disk)
            sizing, size_problems = size_task(task_spec, ds, check_disk)
            problems += size_problems
            warns = warns + (sizing.warnings() if sizing is not None else [])
        elif task_spec.train.command and task_spec.parallel != type(task_spec.parallel)():
            warns = warns + ["[parallel] applies to the built-in trainer; train.command runs your own script, which must "
                             "set up sequence/tensor parallel itself (the degrees are in the plan file)"]
        task_out = str(PurePosixPath(output_dir) / str(index)) if spec.sweep else output_dir
        problems += _resume_from_problems(task_spec, output_dir, task_out, check_disk)
        saving = None
        if ds is not None and not task_spec.train.command:  # our Trainer's saves; a script of the user's saves its own way
            saving = resolve_async_save(task_spec.checkpoint.async_save, bool(task_spec.slurm.gpus_per_node),
                                        sizing.memory if sizing is not None else None, task_spec.slurm.mem)
            problems += [saving.problem] if saving.problem is not None else []
        if problems:
            failing.append(_task_problems(index, overrides, problems))
            continue
        decisions: dict[str, str] = {}
        if sizing is not None and sizing.checkpointing is not None:  # "auto": the estimate decided; the nodes get a bool
            decided = sizing.checkpointing
            task_spec = task_spec.model_copy(update={"train": task_spec.train.model_copy(update={
                "gradient_checkpointing": decided.on, "gradient_checkpointing_layers": decided.layers if decided.on else None})})
            decisions["train.gradient_checkpointing"] = decided.why
        if saving is not None and task_spec.checkpoint.async_save == "auto":  # the nodes get a bool
            task_spec = task_spec.model_copy(update={"checkpoint": task_spec.checkpoint.model_copy(update={"async_save": saving.on})})
            decisions["checkpoint.async_save"] = saving.why
        tasks.append(Task(index, overrides, task_out, task_spec, decisions))
        ds_configs.append(ds)
        sizings.append(sizing)
        for w in warns + advice(task_spec):
            if w not in warnings:
                warnings.append(w)
    _raise_collected(source, failing, len(combos))
    if not spec.has_training:
        warnings.append(NO_TRAIN_NOTE)
    return Plan(
        source=source,
        spec=spec,
        base_dir=base_dir,
        output_dir=output_dir,
        tasks=tasks,
        deepspeed=ds_configs,
        warnings=warnings,
        env=dict(spec.env),
        sizing=sizings,
    )


def write_plan(plan: Plan, sbatch: str | list[str] | None = None, limits: ArrayLimits | None = None) -> Path:
    """Write the plan JSON where every node reads it (``output_dir/swiftslurm-plan.json``), atomically."""
    from .fsutil import atomic_write_text

    path = Path(plan.plan_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(plan.to_json(sbatch, limits), indent=2))
    return path


def read_plan_task(plan_path: str | Path, index: int) -> tuple[dict[str, Any], Task, dict[str, Any] | None]:
    """On a node: the plan JSON, the JobSpec of one task, and its DeepSpeed config."""
    data = json.loads(Path(plan_path).read_text())
    entry = data["tasks"][index]
    spec = JobSpec.model_validate(entry["spec"], strict=False)
    decisions = entry.get("decisions") or {}
    task = Task(entry["index"], entry["overrides"], entry["output_dir"], spec,
                {str(k): str(v) for k, v in decisions.items()} if isinstance(decisions, dict) else {})
    return data, task, data["deepspeed"][index]
