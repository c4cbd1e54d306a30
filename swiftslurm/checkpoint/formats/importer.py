"""Bring a checkpoint we did not write under our guarantees: ``swiftslurm import PATH --into DIR``.

``import_dir`` inspects PATH (``foreign.inspect_dir``: kind, step, world size, ZeRO stage, dtype, and
every file whole), refuses it with the damage named, or places its files under ``DIR/checkpoint-<step>``
(hard links where PATH is on the same filesystem, copies otherwise) and commits them like any
checkpoint of ours: manifest last, rename into place. From then on it verifies like ours, and
``meta.source`` says where it came from. Importing the same PATH again reuses the committed copy.

What PATH names stays inside PATH: a symlink out of it, ``latest`` or a ``weight_map`` entry leading out,
or a directory reached twice refuses the import (exit 2) naming it; files are placed from their real path
inside PATH, so no link is ever committed. The caller owns DIR: ``swiftslurm import`` holds its lock
(``node.ownership.outside_writer``), a run's ``train.resume_from`` imports as the rank that owns it. An
interrupted save or import left in DIR (``.staging-checkpoint-N``) is removed only by DIR's own job
(``owned``); an outside import refuses it rather than delete what may be another job's.
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from pathlib import Path

from ...errors import CheckpointDamaged, SwiftSlurmError
from ...fsutil import DIRECTORY, MISSING, is_inside, open_regular, path_kind
from ..commit import commit, prepare_staging
from ..manifest import ManifestError, read_manifest
from ..names import final_dir, staging_dir
from ..verify import verify
from .foreign import Facts, NotACheckpoint, Outside, inspect_dir, source_files


class ImportRefused(SwiftSlurmError):
    """PATH is missing or not a checkpoint we can read, or the target exists (a user mistake: exit 2)."""

    exit_code = 2


KIND_HINT = ("an HF Trainer checkpoint-N (trainer_state.json, with DeepSpeed's global_stepN and latest), a model "
             "directory (config.json and weights) or a peft adapter directory (adapter_config.json)")


def inspect_or_refuse(src: Path | str) -> Facts:
    """``inspect_dir`` with every refusal a typed error: not found (exit 2), not a kind we read (2), damaged (5)."""
    src = Path(src)
    kind = path_kind(src)
    if kind != DIRECTORY:
        raise ImportRefused("nothing to import: " + ("the path does not exist" if kind == MISSING else "not a directory"),
                            str(src) if kind == MISSING else f"{src}: {kind}", f"give {KIND_HINT}")
    try:
        facts = inspect_dir(src)
    except NotACheckpoint as exc:
        raise ImportRefused("not a checkpoint swiftslurm can import", f"{src}: {exc}", f"give {KIND_HINT}") from None
    except Outside as exc:
        raise _outside(src, exc) from None
    except OSError as exc:
        raise ImportRefused("cannot read the checkpoint", f"{src}: {exc}", "check its permissions") from None
    if facts.problems:
        shown = "; ".join(facts.problems[:3]) + (f" (and {len(facts.problems) - 3} more)" if len(facts.problems) > 3 else "")
        raise CheckpointDamaged(f"the checkpoint to import is damaged: {src}", shown,
                                "copy it again from where it was written; nothing was imported")
    return facts


def _outside(src: Path, exc: Outside) -> ImportRefused:
    return ImportRefused("the checkpoint to import points outside itself", f"{src}: {exc}",
                         "copy the files it points to into it (no links out), or import the directory they live in; nothing was imported")


def check_import(src: Path | str, into: Path | str, owned: bool = False) -> tuple[Facts, bool]:
    """Everything that refuses an import, read-only: ``src`` (``inspect_or_refuse``) and what ``into`` holds at
    its step. ``(facts, True)`` when ``into`` already holds this very import, verified (nothing to do)."""
    src, into = Path(src).resolve(), Path(into)
    facts = inspect_or_refuse(src)
    final = final_dir(into, facts.step)
    if final.exists():
        if _same_import(final, src) and verify(final).ok:
            return facts, True
        raise ImportRefused(f"{final} exists already", _describe(final),
                              "import into another directory, or move it aside")
    leftover = staging_dir(into, facts.step)
    if not owned and (leftover.exists() or leftover.is_symlink()):
        raise ImportRefused(f"a save or import of step {facts.step} is unfinished in {into}", str(leftover),
                            "if no job writes into that dir, remove it and import again (it may be another job's save in progress); nothing was imported")
    return facts, False


def import_dir(src: Path | str, into: Path | str, algo: str = "xxh3", owned: bool = False) -> tuple[Facts, Path]:
    """Import ``src`` into ``into``; returns its facts and the committed, verified checkpoint dir.

    ``owned``: the caller is the job that owns ``into`` (a rank), so a staging dir of the same step left
    there is its own killed attempt and is replaced; otherwise such a dir refuses the import untouched."""
    src, into = Path(src).resolve(), Path(into)
    facts, done = check_import(src, into, owned)
    final = final_dir(into, facts.step)
    if done:
        return facts, final
    try:
        rels = source_files(src)
    except Outside as exc:
        raise _outside(src, exc) from None
    into.mkdir(parents=True, exist_ok=True)
    staging = prepare_staging(into, facts.step)
    meta = {"step": facts.step, "world_size": facts.world_size, "zero_stage": facts.zero_stage, "dtype": facts.dtype,
            "source": {"kind": facts.kind, "path": str(src), "deepspeed": facts.deepspeed, "weights": facts.weights,
                       "imported_at": time.time()}}
    try:
        for rel in rels:
            _place(src, rel, staging / rel)
        commit(staging, final, algo=algo, meta=meta)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # the staging dir this import made, and nothing else
        raise
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


def _place(src: Path, rel: str, dst: Path) -> None:
    """File ``rel`` of ``src`` at ``dst``, from its real path inside ``src`` (never a link, never a file outside):
    a hard link when the filesystem allows it (no copy of large shards), else a copy of the regular file."""
    real = (src / rel).resolve()
    if not is_inside(src, real):  # changed since it was inspected
        raise _outside(src, Outside(f"{rel}: now leads to {real}, outside the checkpoint"))
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        if not stat.S_ISREG(os.stat(real).st_mode):
            raise CheckpointDamaged(f"the checkpoint to import changed while it was imported: {src}", f"{rel}: not a regular file now",
                                    "import it again once nothing writes to it")
        try:
            os.link(real, dst, follow_symlinks=False)
        except OSError:
            with open_regular(real) as fin, open(dst, "wb") as fout:
                shutil.copyfileobj(fin, fout)
    except OSError as exc:
        raise CheckpointDamaged(f"the checkpoint to import could not be read: {src}", f"{rel}: {exc}",
                                "check its permissions, or copy it again from where it was written") from None
