"""Bring a checkpoint we did not write under our guarantees: ``swiftslurm import PATH --into DIR``.

``import_dir`` inspects PATH (``foreign.inspect_dir``: kind, step, world size, ZeRO stage, dtype, and
every file whole), refuses it with the damage named, or places its files under ``DIR/checkpoint-<step>``
(hard links where PATH is on the same filesystem, copies otherwise) and commits them like any
checkpoint of ours: manifest last, rename into place. From then on it verifies like ours, and
``meta.source`` says where it came from. Importing the same PATH again reuses the committed copy.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from ..errors import CheckpointDamaged, SwiftSlurmError
from .commit import commit, prepare_staging
from .foreign import Facts, NotACheckpoint, inspect_dir
from .manifest import ManifestError, read_manifest, walk_files
from .names import final_dir
from .verify import verify

class ImportRefused(SwiftSlurmError):
    """PATH is missing or not a checkpoint we can read, or the target exists (a user mistake: exit 2)."""

    exit_code = 2


KIND_HINT = ("an HF Trainer checkpoint-N (trainer_state.json, with DeepSpeed's global_stepN and latest), a model "
             "directory (config.json and weights) or a peft adapter directory (adapter_config.json)")


def inspect_or_refuse(src: Path | str) -> Facts:
    """``inspect_dir`` with every refusal a typed error: not found (exit 2), not a kind we read (2), damaged (5)."""
    src = Path(src)
    if not src.is_dir():
        raise ImportRefused("nothing to import: " + ("not a directory" if src.exists() else "the path does not exist"),
                            str(src), f"give {KIND_HINT}")
    try:
        facts = inspect_dir(src)
    except NotACheckpoint as exc:
        raise ImportRefused("not a checkpoint swiftslurm can import", f"{src}: {exc}", f"give {KIND_HINT}") from None
    except OSError as exc:
        raise ImportRefused("cannot read the checkpoint", f"{src}: {exc}", "check its permissions") from None
    if facts.problems:
        shown = "; ".join(facts.problems[:3]) + (f" (and {len(facts.problems) - 3} more)" if len(facts.problems) > 3 else "")
        raise CheckpointDamaged(f"the checkpoint to import is damaged: {src}", shown,
                                "copy it again from where it was written; nothing was imported")
    return facts


def import_dir(src: Path | str, into: Path | str, algo: str = "xxh3") -> tuple[Facts, Path]:
    """Import ``src`` into ``into``; returns its facts and the committed, verified checkpoint dir."""
    src, into = Path(src).resolve(), Path(into)
    facts = inspect_or_refuse(src)
    final = final_dir(into, facts.step)
    if final.exists():
        if _same_import(final, src) and verify(final).ok:
            return facts, final
        raise ImportRefused(f"{final} exists already", _describe(final),
                              "import into another directory, or move it aside")
    into.mkdir(parents=True, exist_ok=True)
    staging = prepare_staging(into, facts.step)
    for rel in walk_files(src):
        _place(src / rel, staging / rel)
    meta = {"step": facts.step, "world_size": facts.world_size, "zero_stage": facts.zero_stage, "dtype": facts.dtype,
            "source": {"kind": facts.kind, "path": str(src), "deepspeed": facts.deepspeed, "weights": facts.weights,
                       "imported_at": time.time()}}
    commit(staging, final, algo=algo, meta=meta)
    result = verify(final)
    if not result.ok:  # the source changed while it was placed
        raise CheckpointDamaged(f"the imported copy does not verify: {final}", result.summary(), "import it again")
    return facts, final


def _same_import(final: Path, src: Path) -> bool:
    try:
        return (read_manifest(final).meta.get("source") or {}).get("path") == str(src)
    except ManifestError:
        return False


def _describe(final: Path) -> str:
    try:
        source = read_manifest(final).meta.get("source") or {}
    except ManifestError as exc:
        return f"{final.name}: {exc}"
    return f"imported from {source['path']}" if source.get("path") else "a checkpoint of a swiftslurm run"


def _place(src: Path, dst: Path) -> None:
    """A hard link when the filesystem allows it (no copy of large shards), else a copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
