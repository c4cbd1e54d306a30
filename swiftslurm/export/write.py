"""The export written: a Hugging Face model dir (safetensors shards with their index, config, generation config,
tokenizer with its chat template, or a vision-language model's processor) or a peft adapter dir, with our manifest,
so ``swiftslurm verify DIR`` checks it.

``--to`` must be new or empty: nothing of anyone's is ever overwritten. Everything is built in a hidden dir beside
it (``.<name>.exporting-<pid>``), hashed into ``manifest.json`` (written last), fsynced, and renamed into place: a
kill leaves the hidden dir (never ``--to`` half written), and a failure removes it.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from ..checkpoint.manifest import MANIFEST_NAME, Manifest, body_checksum, hash_files, library_versions, walk_files
from ..fsutil import CONFIG_CAP, atomic_write_text, fsync_path, is_inside, read_json
from .source import ADAPTER_CONFIG, ExportRefused, Source
from .weights import model_kind

Log = Callable[[str], None]
STAGING_INFIX = ".exporting-"
DEFAULT_SHARD = "5GB"
WEIGHTS = ("merged-lora", "full", "adapter")


@dataclass(frozen=True)
class Exported:
    """What an export wrote (``--json`` prints it)."""

    path: str
    source_checkpoint: str
    step: int
    weights: str  # merged-lora | full | adapter
    dtype: str
    base_model: str | None
    files: list[str]
    bytes: int
    skipped: list[str]
    model_class: str = "AutoModelForCausalLM"  # the transformers Auto class that loads it (a reward model's: sequence classification)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_target(to: Path, source_checkpoint: Path) -> None:
    """``to`` may be written: new, or an empty dir, and not inside the source checkpoint (which is only read)."""
    if to.is_symlink() or (to.exists() and not to.is_dir()):
        raise ExportRefused("--to must be a new or empty directory", f"{to} is {'a symlink' if to.is_symlink() else 'a file'}",
                            "pick a new path for the model dir")
    if to.is_dir() and any(to.iterdir()):
        shown = ", ".join(sorted(p.name for p in to.iterdir())[:5])
        raise ExportRefused("--to must be a new or empty directory: export never overwrites files", f"{to} holds {shown}",
                            "pick a new path, or move its files away yourself")
    if is_inside(source_checkpoint, to) or is_inside(to, source_checkpoint):
        raise ExportRefused("--to may not lie inside the checkpoint it exports, nor hold it", f"{to} and {source_checkpoint}",
                            "pick a path outside the checkpoint")


def staging_for(to: Path) -> Path:
    """A new hidden dir beside ``to``, made here (mkdir fails on any name taken, which is then left alone and
    another one tried); the umask's mode, as ``to`` would have."""
    for _ in range(64):
        stage = to.parent / f".{to.name}{STAGING_INFIX}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            stage.mkdir()
            return stage
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free staging name beside it", str(to))


def write_export(src: Source, to: Path, dtype: str, weights: str, max_shard_size: str = DEFAULT_SHARD,
                 log: Log = lambda _m: None) -> Exported:
    """Build the export beside ``to`` and rename it into place (see the module). Loads the model here (torch)."""
    check_target(to, src.checkpoint)
    to.parent.mkdir(parents=True, exist_ok=True)
    stage = staging_for(to)
    try:
        base = _write_weights(src, stage, dtype, weights, max_shard_size, log)
        log(f"export: hashing {len(walk_files(stage))} file(s) into {MANIFEST_NAME}")
        manifest = _seal(src, stage, dtype, weights, base)
        check_target(to, src.checkpoint)  # still new or empty: someone may have written there meanwhile
        try:
            os.rename(stage, to)  # onto a new path, or over an empty dir (POSIX rename: never over a non-empty one)
        except OSError as exc:
            raise ExportRefused("--to changed while the export was written", f"{to}: {exc.strerror}",
                                "pick a new path for the model dir") from None
        fsync_path(to.parent, directory=True)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    log(f"export: wrote {to} ({manifest.total_bytes / 1e6:.1f} MB)")
    return Exported(str(to), str(src.checkpoint), src.step, weights, dtype, base, sorted(manifest.files), manifest.total_bytes,
                    list(src.skipped), model_kind(src)[0])


def _write_weights(src: Source, stage: Path, dtype: str, weights: str, max_shard_size: str, log: Log) -> str | None:
    """The model (or adapter) files and the tokenizer into ``stage``; returns the base model named, if any."""
    from . import weights as w

    if weights == "adapter":
        _write_adapter(src, stage, dtype)
        tok = w.processing_of(src)
        base = src.base_model
    elif weights == "merged-lora":
        model, base_tok = w.merged_model(src, log)
        tok = w.processing_of(src) or base_tok
        base = src.base_model
    else:
        model, tok, base = w.full_model(src, log), w.processing_of(src), None
        _generation_config(src, model)
    if weights != "adapter":
        model = w.cast(model, dtype)
        log(f"export: writing safetensors ({dtype}, shards of at most {max_shard_size})")
        model.save_pretrained(str(stage), max_shard_size=max_shard_size)
    if tok is not None:
        tok.save_pretrained(str(stage))
    return base


def _generation_config(src: Source, model: Any) -> None:
    if (src.checkpoint / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(src.checkpoint), local_files_only=True)


def _write_adapter(src: Source, stage: Path, dtype: str) -> None:
    """The adapter alone, as peft writes one: adapter_config.json naming its base, adapter_model.safetensors."""
    import json

    import torch
    from safetensors.torch import save_file

    from .weights import TORCH_DTYPES, adapter_state

    state = {k: v.to(getattr(torch, TORCH_DTYPES[dtype])).contiguous() for k, v in adapter_state(src).items()}
    save_file(state, str(stage / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = read_json(src.checkpoint / ADAPTER_CONFIG, CONFIG_CAP, wide_ints=True)
    if src.base_model:
        config["base_model_name_or_path"] = src.base_model
    (stage / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _seal(src: Source, stage: Path, dtype: str, weights: str, base: str | None) -> Manifest:
    """Hash every file, fsync it, and write our manifest last: the export verifies like a checkpoint."""
    files = hash_files(stage, None, "xxh3")
    for rel in files:
        fsync_path(stage / rel)
    meta = {"kind": "export", "weights": weights, "dtype": dtype, "base_model": base, "step": src.step,
            "source": {"path": str(src.checkpoint.resolve()), "manifest_checksum": body_checksum(src.manifest.body()),
                       "zero_stage": src.zero_stage},
            "versions": dict(library_versions()), "committed_at": time.time()}
    manifest = Manifest(step=src.step, algo="xxh3_128", files=files, meta=meta)
    atomic_write_text(stage / MANIFEST_NAME, manifest.to_json())
    for d in {(stage / r).parent for r in files} | {stage}:
        fsync_path(d, directory=True)
    return manifest
