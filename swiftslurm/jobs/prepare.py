"""``prepare(spec_path)``: load and validate the spec (every sweep combination), plan every task with the disk
checks, render every batch script and check that bash parses it and reaches its srun line, then scan every
dataset record. ``validate`` says ok exactly when ``submit`` would send the job; what a node would refuse after
the queue wait is refused here.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import Problem, SpecError
from ..plan import ArrayLimits, Plan, make_plan
from ..sizing.check import layout_of
from ..sizing.vision import ImageFacts, ImagePlan, image_plan, read_tower, token_rule
from ..slurm.render import render_all
from ..slurm.scriptcheck import script_problems, setup_problems
from ..spec import JobSpec, load_raw, load_spec, require_training
from ..spec.eval_rules import split_problem
from ..tasks import TASKS


@dataclass(frozen=True)
class Prepared:
    plan: Plan
    scripts: list[str]  # one batch script per sbatch call (``plan.arrays(limits)``), each checked with bash -n
    notes: list[str] = field(default_factory=list)  # what the dataset scan found (counts, time)
    images: dict[int, ImagePlan] = field(default_factory=dict)  # task index -> its dataset's images (none: no image)


def prepare(spec_path: str | os.PathLike[str], *, training: bool = False, limits: ArrayLimits | None = None,
            base_dir: str | None = None) -> Prepared:
    """Every check of a spec file, then its plan and scripts. Raises SpecError (every problem of the spec) or
    ``train.records.DataError`` (a malformed dataset record, with its file and line).

    ``training`` (submit, render): a spec without [train] is refused; validate, plan and preflight take it (the plan
    carries a note). ``base_dir``: where relative paths start (default: the current directory).
    """
    source = str(spec_path)
    spec = load_spec(spec_path)
    if training:
        require_training(spec, source)
    plan = make_plan(spec, load_raw(spec_path), base_dir=base_dir or os.getcwd(), source=source, check_disk=True)
    check_trackers(plan)
    check_resume_sources(plan)
    scripts = render_all(plan, limits=limits)  # also what must go on #SBATCH lines, and the container's mounts
    check_scripts(plan, scripts)
    scan = scan_data(plan)
    return Prepared(plan, scripts, scan.notes, scan.images)


def check_scripts(plan: Plan, scripts: list[str]) -> None:
    """Each group's ``slurm.setup`` lines, then each rendered script, through bash's parser (SpecError)."""
    problems: list[Problem] = []
    seen: set[tuple[str, ...]] = set()
    for group in plan.groups:
        setup = tuple(group.slurm.setup)
        if setup and setup not in seen:
            seen.add(setup)
            problems += setup_problems(list(setup))
    if not problems:
        for script in dict.fromkeys(scripts):
            problems += script_problems(script)
            if problems:
                break
    if problems:
        raise SpecError(plan.source, problems)


def check_trackers(plan: Plan) -> None:
    """``report_to = ["wandb"]`` / ``"mlflow"``: a library missing here is missing on the nodes when the ranks run this
    very interpreter (no container, no other slurm.python); elsewhere the node checks before training (SpecError)."""
    from ..train.tracking.identity import login_problem

    problems: list[Problem] = []
    for task in plan.tasks:
        s = task.spec
        if not s.has_training or s.train.command:
            continue
        problem = login_problem(s, same_interpreter=s.container is None and s.slurm.python in (None, sys.executable))
        if problem is not None and problem not in problems:
            problems.append(problem)
    if problems:
        raise SpecError(plan.source, problems)


FIRST_RECORD = {"hf-trainer": "trainer_state.json", "peft-adapter": "adapter_config.json", "hf-model": "config.json"}


def check_resume_sources(plan: Plan) -> None:
    """``train.resume_from``: what rank 0 would refuse after the queue wait, before any tensor is read (SpecError):
    a directory that is no checkpoint of any kind we start from, or one whose first record (a checkpoint of ours:
    its manifest; another's: trainer_state.json, adapter_config.json or config.json) cannot be read. Files are
    hashed on the node (here: `swiftslurm verify`); nothing is imported or loaded here."""
    from ..checkpoint import MANIFEST_NAME, ManifestError, list_checkpoints, read_manifest
    from ..checkpoint.formats.foreign import kind_of
    from ..checkpoint.formats.importer import KIND_HINT
    from ..fsutil import CONFIG_CAP, Unreadable, read_json

    problems: list[Problem] = []
    for src in dict.fromkeys(t.spec.train.resume_from for t in plan.tasks if t.spec.has_training and t.spec.train.resume_from):
        try:
            names = {p.name for p in os.scandir(src)}
            steps = list_checkpoints(src) if MANIFEST_NAME not in names else []
            if any(os.path.lexists(os.path.join(c, MANIFEST_NAME)) for c in steps):
                continue  # another run's output dir: its newest verified checkpoint, chosen on the node
            if steps:
                problems.append(Problem("train.resume_from", "its checkpoint-N dirs are none of ours (no manifest.json)",
                                        f"{src}: {', '.join(sorted(os.path.basename(c) for c in map(str, steps))[:5])}",
                                        "point train.resume_from at one of them (an HF Trainer checkpoint-N is imported), "
                                        "or `swiftslurm import` it first"))
                continue
            kind = "ours" if MANIFEST_NAME in names else kind_of(names)
            if kind is None:
                shown = ", ".join(sorted(names)[:8]) + (f", ... ({len(names)} entries)" if len(names) > 8 else "") if names else "nothing"
                problems.append(Problem("train.resume_from", "not a checkpoint a run can start from", f"{src} holds {shown}",
                                        f"a checkpoint-N of ours, a run's output dir, or {KIND_HINT}"))
                continue
            if kind == "ours":  # the manifest as rank 0 reads it: its shape and body checksum (file hashes: on the node)
                read_manifest(Path(src))
            else:
                read_json(os.path.join(src, FIRST_RECORD[kind]), CONFIG_CAP, wide_ints=True)
        except ManifestError as exc:
            problems.append(Problem("train.resume_from", "the checkpoint to start from has a manifest that cannot be trusted",
                                    f"{os.path.join(src, MANIFEST_NAME)}: {exc}",
                                    "point train.resume_from at an intact checkpoint (`swiftslurm verify DIR` checks one)"))
        except (OSError, Unreadable) as exc:
            why = str(exc) if isinstance(exc, Unreadable) else f"{exc.filename or src}: {exc.strerror or exc}"
            problems.append(Problem("train.resume_from", "the checkpoint to start from cannot be read", why,
                                    "check the files and their permissions (`swiftslurm verify DIR` for one of ours)"))
    if problems:
        raise SpecError(plan.source, problems)


@dataclass(frozen=True)
class DataScan:
    notes: list[str]  # one a scan, for ``validate``
    images: dict[int, ImagePlan]  # task index -> what ``plan`` shows of its dataset's images (a dataset with images)


def scan_data(plan: Plan) -> DataScan:
    """Every record of each task's dataset checked (``train.dataset_scan``), once per distinct file list, by the
    ``count_records`` of the data module its task's row names (``swiftslurm/tasks.py``): SFT records, ``{"text"}`` records
    for ``task = "pt"``, prompt/chosen/rejected pairs for ``"dpo"`` and ``"rm"``, prompt/completion/label records for
    ``"kto"``, prompts for ``"grpo"``; a malformed record is a DataError naming its file and line. A dataset with
    images (``train/data/images.py``) is scanned again for a task whose max_length or resolution bounds differ (they
    decide what its images may take)."""
    from ..train.data.images import Scanned

    notes: list[str] = []
    images: dict[int, ImagePlan] = {}
    seen: dict[tuple[str, tuple[str, ...]], tuple[tuple[int, int, int], ImageFacts | None]] = {}  # -> (bounds, facts)
    for task in plan.tasks:
        t = task.spec.train
        if not task.spec.has_training or t.command:
            continue
        bounds = (t.max_length, t.image_min_pixels, t.image_max_pixels)
        known = seen.get((t.task, tuple(t.dataset)))
        if known is not None and (known[1] is None or known[0] == bounds):
            if known[1] is not None:
                images[task.index] = _image_plan(task.spec, known[1])
            continue
        if t.task == "grpo":
            check_reward_files(plan.source, t.reward_funcs)  # even without the scan: a missing file fails every rank
        seen[(t.task, tuple(t.dataset))] = (bounds, None)
        if not t.dataset_scan:
            notes.append(f"dataset not scanned (train.dataset_scan = false): {len(t.dataset)} file(s)")
            continue
        start = time.monotonic()
        row = TASKS[t.task]
        counted = importlib.import_module(f"..train.data.{row.data}", __package__).count_records(t)
        count, facts = (counted.count, counted.images) if isinstance(counted, Scanned) else (counted, None)
        if t.eval_split > 0:
            bad = split_problem(count, t.eval_split, layout_of(task.spec).global_batch)
            if bad:
                raise SpecError(plan.source, [Problem("train.eval_split", *bad)])
        notes.append(f"dataset: {count:,} {row.counts} in {len(t.dataset)} file(s) checked in {time.monotonic() - start:.1f} s")
        if facts is not None:
            seen[(t.task, tuple(t.dataset))] = (bounds, facts)
            images[task.index] = _image_plan(task.spec, facts)
            shown = images[task.index]
            takes = (f"each takes {shown.tokens_max:,} tokens ({shown.rule.words})" if shown.rule.fixed is not None
                     else f"one takes up to {shown.tokens_max:,} tokens (train.image_max_pixels)")
            notes.append(f"images: {facts.images:,} in {facts.records:,} record(s) checked, up to {facts.max_per_record} a "
                         f"record; {takes}")
    return DataScan(notes, images)


def _image_plan(spec: JobSpec, facts: ImageFacts) -> ImagePlan:
    t = spec.train
    return image_plan(facts, min_pixels=t.image_min_pixels, max_pixels=t.image_max_pixels, max_length=t.max_length,
                      micro_batch=t.per_device_train_batch_size, freeze_vision=t.freeze_vision,
                      half_precision=t.bf16 or t.fp16, tower=read_tower(t.model), rule=token_rule(t.model))


def check_reward_files(source: str, reward_funcs: list[str]) -> None:
    """Each ``file.py:function`` reward (made absolute by the plan) names a file; its code is not imported here."""
    from ..fsutil import RECORD_CAP, Unreadable, read_text
    from ..spec.grpo_rules import FILE_REWARD_RE, reward_definition_problem

    problems = []
    for i, name in enumerate(reward_funcs):
        m = FILE_REWARD_RE.fullmatch(name)
        if not m:
            continue
        if not os.path.isfile(m.group(1)):
            problems.append(Problem(f"train.reward_funcs[{i}]", "the reward function's file does not exist", m.group(1),
                                    "a file.py:function is found relative to the spec's directory"))
            continue
        try:  # parsed, never imported: nothing of the user's file runs at validate
            bad = reward_definition_problem(read_text(m.group(1), RECORD_CAP, errors="replace"), m.group(2))
        except (OSError, Unreadable) as exc:
            bad = ("the reward function's file cannot be read", str(exc))
        if bad:
            problems.append(Problem(f"train.reward_funcs[{i}]", bad[0], f"{m.group(1)}: {bad[1]}",
                                    "name a top-level def f(prompts, completions, **columns) -> list[float] of that file"))
    if problems:
        raise SpecError(source, problems)
