"""``train.resume_from``: a new run (its own output dir) starts from another checkpoint.

Where a run starts (``resolve_start``), on every start, requeues included:

1. its OWN newest verified checkpoint, when it has one: a requeued run continues itself, never restarts
   from ``resume_from``;
2. else ``train.resume_from``, prepared by rank 0 (``prepare_source``): a checkpoint of ours is verified
   (damage stops the run on every rank: CheckpointDamaged, exit 5, naming the files); another run's output
   dir gives its newest verified one; a checkpoint we did not write is imported (``checkpoint.formats.importer``)
   into ``<output_dir>/resume-source/`` and verified there. Every rank then checks it can read it;
3. else a fresh start.

A full resume restores weights, optimizer, scheduler, every rank's RNG and the data position (the HF
Trainer's ``resume_from_checkpoint`` on that directory). ``train.resume_weights_only`` (always so for a
model or adapter dir, which hold no training state) loads only the weights (``load_weights``) and starts
at step 0 with a fresh optimizer, schedule and data order. A checkpoint written by another data-parallel size
or ZeRO stage is converted into ``<output_dir>/universal/`` like the run's own (``worldsize.adapt``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import checkpoint as ck
from ...checkpoint.formats.importer import import_dir
from ...errors import CheckpointDamaged, CheckpointUnreadable, RuntimeEnvError, SwiftSlurmError
from ...taskdir import RESUME_SOURCE_DIR as IMPORT_DIR  # under output_dir: not a checkpoint-N of the run, so never its own resume point
from . import agree as resume

if TYPE_CHECKING:
    from ...spec.model import JobSpec

log = logging.getLogger("swiftslurm.train")


@dataclass(frozen=True)
class Start:
    path: str | None = None  # the checkpoint to start from (None: fresh)
    weights_only: bool = False
    source: str = ""  # "own", "resume_from", "explicit" or "" (fresh)

    @property
    def full_resume(self) -> str | None:
        """The directory for ``Trainer.train(resume_from_checkpoint=...)``: None when only weights are loaded."""
        return None if self.weights_only else self.path


def resolve_start(resume_arg: str | bool | None, spec: JobSpec, output_dir: str, rank: int, node: str) -> Start:
    """Where this run starts, the same on every rank (see the module docstring)."""
    if resume_arg is not True:  # an explicit path from the local launcher, or None: as before
        found = resume.resolve(resume_arg, output_dir, rank, node)
        return Start(found, False, "explicit" if found else "")
    fallback = spec.train.resume_from is not None  # then "no checkpoint here: starting fresh" would be wrong
    say = (lambda msg: None if msg.startswith("swiftslurm: no verified checkpoint") else print(msg)) if fallback else print
    own = resume.agreed_resume_point(output_dir, rank, node, log=say)
    if own is not None or spec.train.resume_from is None:
        return Start(own, False, "own" if own else "")
    prepared = _prepare_on_rank_0(spec, spec.train.resume_from, output_dir) if rank == 0 else {}
    prepared = resume.exchange().broadcast(prepared)
    if "error" in prepared:
        code, what, found, hint = prepared["error"]
        error = SwiftSlurmError(what, found, hint)
        error.exit_code = code  # the same message and exit code on every rank (5 for damage)
        error.agreed = True  # every rank raises it here: they may leave the process group together (run.train)
        raise error
    chosen = ck.agree_resume_point(output_dir, rank, node, resume.exchange(), lambda: Path(prepared["path"]), log.warning)
    return Start(str(chosen), bool(prepared["weights_only"]), "resume_from")


def _prepare_on_rank_0(spec: JobSpec, src: str, output_dir: str) -> dict[str, Any]:
    """``prepare_source`` (of ``train.resume_from = src``) as a broadcastable verdict: the path, or the error every rank
    must raise alike."""
    try:
        path, weights_only = prepare_source(src, output_dir, spec)
        return {"path": str(path), "weights_only": weights_only}
    except SwiftSlurmError as exc:  # every rank must stop with the same message, none may wait on rank 0
        return {"error": [exc.exit_code, exc.what, exc.found, exc.hint]}
    except OSError as exc:
        return {"error": [CheckpointUnreadable.exit_code, "cannot read train.resume_from", f"{spec.train.resume_from}: {exc}",
                          "check that every node sees it (a shared filesystem) and its permissions"]}
    except Exception as exc:  # noqa: BLE001 - never leave the other ranks waiting in the broadcast
        return {"error": [1, "could not prepare train.resume_from", f"{spec.train.resume_from}: {type(exc).__name__}: {exc}",
                          "run `swiftslurm import PATH --into DIR` on it to see what it holds; report this with `--debug`"]}


def prepare_source(src: str, output_dir: str, spec: JobSpec) -> tuple[Path, bool]:
    """(a verified checkpoint of ours to start from, weights only?) for ``train.resume_from = src`` (rank 0)."""
    path = Path(src)
    if not path.is_dir():
        raise CheckpointUnreadable("train.resume_from is not a directory on this node", str(path),
                                   "every node must see it (a shared filesystem); `swiftslurm validate` checks it where you submit")
    weights_only = bool(spec.train.resume_weights_only)
    if (path / ck.MANIFEST_NAME).exists():
        result = ck.verify(path)
        if not result.ok:
            raise _damaged(path, result.problems)
        chosen = path
    elif ck.list_checkpoints(path):
        skipped: list[str] = []
        newest = ck.newest_verified(path, log=skipped.append)
        if newest is None:
            raise _damaged(path, [m.replace("swiftslurm: skipping damaged ", "") for m in skipped])
        chosen = newest
    else:
        # rank 0 of the job that owns output_dir (its lock): a killed earlier attempt's staging dir is its own
        facts, chosen = import_dir(path, Path(output_dir) / IMPORT_DIR, spec.checkpoint.checksum, owned=True)
        log.warning("train.resume_from: imported %s (%s, step %d, world size %s, ZeRO stage %s, %s) into %s", path,
                    facts.kind, facts.step, facts.world_size or "?", facts.zero_stage if facts.zero_stage is not None else "-",
                    facts.dtype or "dtype ?", chosen)
        if facts.kind != "hf-trainer" and not weights_only:
            log.warning("train.resume_from: a %s holds no optimizer, schedule or data position: starting from its weights "
                        "at step 0 (as train.resume_weights_only = true)", facts.kind)
            weights_only = True
    if not weights_only:
        _check_fits(chosen)
    return chosen, weights_only


def _damaged(path: Path, problems: list[str]) -> CheckpointDamaged:
    shown = "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
    return CheckpointDamaged(f"train.resume_from is damaged: not starting from {path}", shown or "no checkpoint verifies",
                             f"`swiftslurm verify {path}` lists every damaged file; point train.resume_from at a checkpoint that verifies")


def _check_fits(ckpt: Path) -> None:
    """A full resume needs DeepSpeed's optimizer shards. Another data-parallel size or ZeRO stage is fine: the
    trainer converts the checkpoint to a universal one in the run's own dir (``worldsize.adapt``), or refuses it
    there with the reason and the manual way."""
    manifest = ck.read_manifest(ckpt)
    if not any(rel.startswith("global_step") for rel in manifest.files):
        raise RuntimeEnvError(
            "train.resume_from holds no DeepSpeed optimizer state to resume (written without DeepSpeed)", str(ckpt),
            "set train.resume_weights_only = true to start from its weights with a fresh optimizer")


def load_weights(model: Any, start: Start, stage: str, train_type: str) -> None:
    """With ``start.weights_only``, load the checkpoint's weights into ``model``. ``stage`` "base": full weights
    into the model before LoRA wraps it; "adapter": an adapter into the peft model. A no-op otherwise."""
    if not start.weights_only or not start.path:
        return
    from .weights import load_adapter, load_full

    ckpt = Path(start.path)
    if stage == "base":
        load_full(model, ckpt, train_type)
    else:
        load_adapter(model, ckpt)
