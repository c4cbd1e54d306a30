"""What ``swiftslurm export SOURCE`` exports: one verified checkpoint of ours, and what it holds. No torch here.

SOURCE is a ``checkpoint-N`` dir, a task's output dir, a sweep's output dir with ``--task``, or a job id (resolved
as every TARGET is: ``jobs.target``). Of an output dir the best checkpoint (the eval's ``latest_best`` pointer) is
taken when there is one, else the newest that verifies. The checkpoint is verified (every file hashed against our
manifest) before anything is loaded; a checkpoint without our manifest is refused (``swiftslurm import`` first).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..checkpoint import list_checkpoints, step_of, verify
from ..checkpoint.manifest import MANIFEST_NAME, Manifest, walk_files
from ..errors import CheckpointDamaged, SwiftSlurmError
from ..fsutil import CONFIG_CAP, DIRECTORY, MISSING, TAG_CAP, UNREACHABLE, Unreadable, is_inside, path_kind, read_json, read_text
from ..jobs.target import resolve
from ..taskdir import LATEST_BEST_NAME  # the eval's pointer (checkpoint/best.py writes it)
from ..tasks import TASKS

# The eval's pointer to the best checkpoint of a task dir (by eval metric): one line naming a checkpoint-N dir.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")
TAG_RE = re.compile(r"^global_step\d+$")
DTYPES = ("bf16", "fp16", "fp32")

Log = Callable[[str], None]


class ExportRefused(SwiftSlurmError):
    """SOURCE or ``--to`` cannot be exported from or into (exit 2: what was given is not usable as is)."""

    exit_code = 2


SHARD_RE = re.compile(r"\s*(\d{1,6}(?:\.\d{1,6})?)\s*([KMGT]B)\s*", re.IGNORECASE)
SHARD_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}  # as transformers' save_pretrained reads them


def shard_bytes(text: str) -> int:
    """``--max-shard-size`` in bytes, checked before anything is loaded (pure): a number and KB, MB, GB or TB."""
    m = SHARD_RE.fullmatch(text)
    size = int(float(m.group(1)) * SHARD_UNITS[m.group(2).upper()]) if m else 0
    if not 1000 <= size <= 10**15:
        raise ExportRefused("--max-shard-size must be a size from 1KB to 1000TB", repr(text),
                            "a number and KB, MB, GB or TB (powers of 1000, as transformers reads them): 5GB, 500MB")
    return size


@dataclass(frozen=True)
class Source:
    """A verified checkpoint and what the export needs of it."""

    checkpoint: Path
    manifest: Manifest
    lora: bool  # holds a LoRA adapter (train_type = "lora")
    base_model: str | None  # what the adapter was trained on (train.model), for a merge
    train_dtype: str  # bf16 | fp16 | fp32: what the run trained in (the default --dtype)
    zero_tag: str | None  # the DeepSpeed ``global_stepN`` dir holding ZeRO shards, when there is one
    zero_stage: int | None
    fingerprint: dict[str, Any] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()  # newer checkpoints passed over as damaged, one line each
    score_head: bool = False  # a reward model (task = "rm"): a sequence-classification model with one score, no LM head
    takes_images: bool = False  # a vision-language model: the run saved its processor (tokenizer and image processor)

    @property
    def step(self) -> int:
        return self.manifest.step


def best_checkpoint(task_dir: Path) -> Path | None:
    """The checkpoint the eval's ``latest_best`` pointer names in ``task_dir``, or None without a pointer.
    The one lookup of the best checkpoint: a pointer that leads outside ``task_dir`` is refused."""
    pointer = task_dir / LATEST_BEST_NAME
    try:
        name = read_text(pointer, TAG_CAP).strip().splitlines()[0].strip() if pointer.exists() else ""
    except (Unreadable, IndexError) as exc:
        raise ExportRefused("the best-checkpoint pointer cannot be read", str(exc), f"pass a checkpoint-N dir of {task_dir} instead") from None
    if not name:
        return None
    target = task_dir / name
    if step_of(target) is None or not is_inside(task_dir, target):
        raise ExportRefused(f"{LATEST_BEST_NAME} does not name a checkpoint-N dir of its task dir", f"{pointer}: {name[:200]!r}",
                            f"pass a checkpoint-N dir of {task_dir} instead")
    return target


def task_dir_of(source: str, task: int | None) -> Path:
    """The one task dir an output dir (or job id) names; a sweep needs ``task``."""
    _sub, refs = resolve(source)
    if task is not None:
        refs = [r for r in refs if r.task == task]
        if not refs:
            raise ExportRefused(f"{source} has no task {task}", "", "`swiftslurm status SOURCE` lists its tasks")
    if len(refs) != 1:
        listed = ", ".join(f"{r.task}: {r.task_dir}" for r in refs[:8])
        raise ExportRefused(f"{source} holds {len(refs)} tasks; export takes one", listed, "add --task N (or pass that task's dir)")
    if not refs[0].task_dir or not Path(refs[0].task_dir).is_dir():
        raise ExportRefused(f"no output dir of {source} is here", refs[0].task_dir or "Slurm records no dir",
                            "pass the job's output dir or a checkpoint-N dir")
    return Path(refs[0].task_dir)


def is_checkpoint(path: Path) -> bool:
    return step_of(path) is not None or (path / MANIFEST_NAME).exists()


def pick_checkpoint(source: str, task: int | None, log: Log) -> Path:
    """The checkpoint SOURCE names (not yet verified), or the task dir whose newest verified one to take."""
    path = Path(source)
    kind = path_kind(path)
    if kind == DIRECTORY and is_checkpoint(path):
        return path
    if kind == MISSING and not source.split("_")[0].isdigit():
        raise ExportRefused("nothing to export: the path does not exist", source, "pass a checkpoint-N dir or the job's output dir")
    if kind.startswith(UNREACHABLE):
        raise ExportRefused("nothing to export: the path cannot be looked at", f"{source}: {kind}",
                            "check the path (each name at most 255 bytes) and its permissions")
    task_dir = task_dir_of(source, task)
    best = best_checkpoint(task_dir)
    if best is not None:
        log(f"export: {task_dir / LATEST_BEST_NAME} names {best.name} (the best by the eval)")
        return best
    if not list_checkpoints(task_dir):
        raise ExportRefused(f"no checkpoint under {task_dir}", "no checkpoint-N dir", "wait for the run's first save, or pass a checkpoint-N dir")
    return task_dir


def verified(ckpt: Path, log: Log) -> tuple[Path, Manifest]:
    """``ckpt`` hashed against its manifest, every file a regular one inside it; CheckpointDamaged otherwise."""
    size = _manifest_size(ckpt)
    log(f"export: verifying {ckpt} ({size / 1e6:.1f} MB)")
    result = verify(ckpt)
    if result.manifest is None and not (ckpt / MANIFEST_NAME).exists():
        raise CheckpointDamaged(f"not a checkpoint of ours: {ckpt}", "no manifest.json: nothing says which files are whole",
                                f"`swiftslurm import {ckpt} --into DIR` checks a checkpoint we did not write; export DIR/checkpoint-N then")
    if not result.ok or result.manifest is None:
        more = f" (and {len(result.problems) - 3} more)" if len(result.problems) > 3 else ""
        raise CheckpointDamaged(f"the checkpoint to export is damaged: {ckpt}", "; ".join(result.problems[:3]) + more,
                                f"`swiftslurm verify {ckpt}` lists every damaged file; export a checkpoint that verifies")
    outside = [rel for rel in walk_files(ckpt) if (ckpt / rel).is_symlink() or not is_inside(ckpt, ckpt / rel)]
    if outside:
        raise CheckpointDamaged(f"the checkpoint to export holds symlinks: {ckpt}", ", ".join(outside[:3]),
                                "a committed checkpoint holds only regular files: copy the files it names in their place")
    return ckpt, result.manifest


def _manifest_size(ckpt: Path) -> int:
    from ..checkpoint import ManifestError, read_manifest

    try:
        return read_manifest(ckpt).total_bytes
    except ManifestError:
        return 0


def newest_verified(task_dir: Path, log: Log) -> tuple[Path, Manifest, list[str]]:
    """Newest to oldest, the first checkpoint of ``task_dir`` that verifies, and the damaged ones passed over."""
    skipped: list[str] = []
    for ckpt in list_checkpoints(task_dir):
        try:
            return (*verified(ckpt, log), skipped)
        except CheckpointDamaged as exc:
            skipped.append(f"{ckpt.name}: {exc.found}")
            log(f"export: skipping damaged {ckpt.name}: {exc.found}")
    raise CheckpointDamaged(f"no checkpoint under {task_dir} verifies", "; ".join(skipped[:3]),
                            f"`swiftslurm verify {task_dir}` lists what is damaged")


def find_source(source: str, task: int | None = None, base_model: str | None = None, log: Log = lambda _m: None) -> Source:
    """The verified checkpoint SOURCE names and what it holds (reads and hashes files; loads no tensor)."""
    picked = pick_checkpoint(source, task, log)
    if is_checkpoint(picked):
        ckpt, manifest = verified(picked, log)
        skipped: list[str] = []
    else:
        ckpt, manifest, skipped = newest_verified(picked, log)
    return describe(ckpt, manifest, base_model, tuple(skipped))


def describe(ckpt: Path, manifest: Manifest, base_model: str | None = None, skipped: tuple[str, ...] = ()) -> Source:
    """What a verified checkpoint holds: LoRA or full, the base model, the training dtype, its ZeRO shards."""
    recorded = manifest.meta.get("spec_fingerprint")
    fp: dict[str, Any] = recorded if isinstance(recorded, dict) else {}
    lora = any((ckpt / name).is_file() for name in ADAPTER_FILES)
    if lora and not (ckpt / ADAPTER_CONFIG).is_file():
        raise CheckpointDamaged(f"the adapter of {ckpt} has no {ADAPTER_CONFIG}", "adapter weights without their config",
                                "export a checkpoint written by swiftslurm's trainer or peft")
    base = base_model or _str(fp.get("train.model")) or (_adapter_base(ckpt) if lora else None)
    train_dtype = "bf16" if fp.get("train.bf16") else "fp16" if fp.get("train.fp16") else _config_dtype(ckpt)
    tags = sorted(p.name for p in ckpt.iterdir() if p.is_dir() and TAG_RE.match(p.name))
    stage = manifest.meta.get("zero_stage")
    return Source(ckpt, manifest, lora, base, train_dtype, tags[-1] if tags else None,
                  stage if isinstance(stage, int) else None, dict(fp), skipped, _score_head(ckpt, fp, lora),
                  any((ckpt / name).is_file() for name in PROCESSOR_FILES))


PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")  # what a processor with an image processor saves


def _score_head(ckpt: Path, fp: dict[str, Any], lora: bool) -> bool:
    """A reward model's checkpoint: its task's registry row says so (``train.task`` of the manifest), else what the
    files say: peft's SEQ_CLS task type for an adapter, a ``*ForSequenceClassification`` architecture for full weights."""
    task = fp.get("train.task")
    if isinstance(task, str) and task in TASKS:
        return TASKS[task].score_head
    try:
        if lora:
            return read_json(ckpt / ADAPTER_CONFIG, CONFIG_CAP, wide_ints=True).get("task_type") == "SEQ_CLS"
        named = read_json(ckpt / "config.json", CONFIG_CAP, wide_ints=True).get("architectures")
    except (OSError, Unreadable):
        return False
    return isinstance(named, list) and any(isinstance(a, str) and a.endswith("ForSequenceClassification") for a in named)


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _adapter_base(ckpt: Path) -> str | None:
    try:
        return _str(read_json(ckpt / ADAPTER_CONFIG, CONFIG_CAP, wide_ints=True).get("base_model_name_or_path"))
    except (OSError, Unreadable):
        return None


def _config_dtype(ckpt: Path) -> str:
    """The dtype a model dir's config.json names, as bf16/fp16/fp32 (fp32 when it names none)."""
    try:
        config = read_json(ckpt / "config.json", CONFIG_CAP, wide_ints=True)
    except (OSError, Unreadable):
        return "fp32"
    named = config.get("dtype") or config.get("torch_dtype")
    return {"bfloat16": "bf16", "float16": "fp16"}.get(named if isinstance(named, str) else "", "fp32")
