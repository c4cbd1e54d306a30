"""Resume on another data-parallel world size (or ZeRO stage): a DeepSpeed universal checkpoint as a verified sibling.

A ZeRO-1/2/3 checkpoint holds one optimizer partition per data-parallel rank; DeepSpeed refuses to load it on
another DP size ("The checkpoint being loaded used a DP world size of X ..."). DeepSpeed's universal-checkpoint
tool (``ds_to_universal``, run as ``python -m swiftslurm.checkpoint.formats.ds_convert``: weights-only loads)
rewrites the partitions per parameter, independent of the world size, and ``"checkpoint": {"load_universal": true}`` loads that on any size.

``plan_load`` (pure) decides from the writer's layout (manifest meta, else the shard files) and this run's:
load as is, convert, or refuse with the reason and the manual way. ``convert`` (one rank) writes the sibling
``<output_dir>/universal/checkpoint-<step>``: the source's shared files (trainer state, scheduler, RNG states,
weights; hard links where possible) plus ``global_step<N>_universal/`` and ``latest_universal`` from the tool,
sealed by the same ``commit`` as any checkpoint (staging dir, manifest last, rename): a kill mid-conversion
leaves a staging dir, never a sibling that looks good. A sibling is reused when it verifies and names the
source's manifest checksum; siblings of other steps (and staging dirs of killed conversions) are removed after
a conversion.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ...errors import SwiftSlurmError
from ...taskdir import UNIVERSAL_DIR
from ..commit import commit, prepare_staging
from ..manifest import body_checksum, read_manifest
from ..names import STAGING_PREFIX, final_dir, step_of
from ..verify import verify

_OPTIM = re.compile(r"^global_step\d+/(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL_MP = re.compile(r"^global_step\d+/mp_rank_(\d+)_model_states\.pt$")


class CheckpointNotConvertible(SwiftSlurmError):
    """The checkpoint was written by another world size / ZeRO stage and DeepSpeed cannot convert it."""

    exit_code = 1


@dataclass(frozen=True)
class Layout:
    """How a checkpoint was (or a run is) partitioned: data-parallel ranks, ZeRO stage, model-parallel degree."""

    dp_world_size: int
    zero_stage: int
    mp_degree: int = 1
    # per-rank optimizer partitions on disk (ZeRO-1/2/3, or DeepSpeed's bf16 optimizer at ZeRO-0); not compared
    partitioned: bool = field(default=False, compare=False)

    def describe(self) -> str:
        mp = f", model-parallel degree {self.mp_degree}" if self.mp_degree != 1 else ""
        return f"{self.dp_world_size} data-parallel rank(s) at ZeRO-{self.zero_stage}{mp}"


@dataclass(frozen=True)
class LoadPlan:
    action: str  # "as_is" | "convert" | "refuse"
    writer: Layout
    reader: Layout
    reason: str = ""


def writer_layout(meta: dict[str, Any], files: dict[str, Any]) -> Layout:
    """The writer's layout (pure): ``meta["dp_world_size"]``/``meta["zero_stage"]`` when the trainer recorded them,
    else read off the DeepSpeed files (one ``*_optim_states.pt`` per DP rank; ZeRO-0 writes none) and the spec
    fingerprint's ZeRO stage."""
    dp_ranks = {int(m.group(1)) for m in map(_OPTIM.match, files) if m}
    mp = {int(m.group(2)) for m in map(_OPTIM.match, files) if m} | {int(m.group(1)) for m in map(_MODEL_MP.match, files) if m}
    stage = meta.get("zero_stage")
    if stage is None:
        stage = (meta.get("spec_fingerprint") or {}).get("deepspeed.zero_optimization.stage")
    if stage is None:
        stage = 0 if not dp_ranks else None
    dp = meta.get("dp_world_size") or (len(dp_ranks) if dp_ranks else meta.get("world_size") or 1)
    return Layout(int(dp), int(stage) if stage is not None else -1, max(len(mp), 1), partitioned=bool(dp_ranks))


def plan_load(writer: Layout, reader: Layout) -> LoadPlan:
    """Load as is, convert to a universal checkpoint, or refuse (pure)."""
    if writer == reader:
        return LoadPlan("as_is", writer, reader)
    if writer.zero_stage == reader.zero_stage == 0 and writer.mp_degree == reader.mp_degree:
        if not writer.partitioned:  # ZeRO-0 keeps the whole optimizer in mp_rank_00: any DP size loads it
            return LoadPlan("as_is", writer, reader)
        return LoadPlan("refuse", writer, reader, "a ZeRO-0 checkpoint with per-rank optimizer partitions (DeepSpeed's "
                        "bf16 optimizer) is not converted here (untested)")
    if writer.mp_degree != 1 or reader.mp_degree != 1:
        return LoadPlan("refuse", writer, reader, "a change of tensor/pipeline-parallel degree is not converted here "
                        "(swiftslurm trains with data parallelism only)")
    if writer.zero_stage < 0:
        return LoadPlan("refuse", writer, reader, "the checkpoint does not say its ZeRO stage and has no optimizer partitions")
    if writer.zero_stage == 0:
        return LoadPlan("refuse", writer, reader, "a ZeRO-0 checkpoint has no per-rank optimizer partitions for "
                        "DeepSpeed's universal-checkpoint tool to convert (DeepSpeed issue 7200)")
    if reader.zero_stage == 0:
        return LoadPlan("refuse", writer, reader, "DeepSpeed loads a universal checkpoint only into a ZeRO-1/2/3 optimizer")
    if writer.zero_stage == 3 and reader.zero_stage < 3:
        return LoadPlan("refuse", writer, reader, "DeepSpeed's tool writes a ZeRO-3 checkpoint's optimizer state in a "
                        "layout only ZeRO-3 loads (flat tensors, no per-parameter step); to leave ZeRO-3, carry the "
                        "weights: train.resume_from = this checkpoint with train.resume_weights_only = true (a fresh "
                        "optimizer and schedule)")
    return LoadPlan("convert", writer, reader)


def _plain(layout: Layout) -> dict[str, int]:
    return {"dp_world_size": layout.dp_world_size, "zero_stage": layout.zero_stage, "mp_degree": layout.mp_degree}


def manual_way(src: Path | str, output_dir: Path | str, writer: Layout) -> str:
    """What a person can do instead (one line)."""
    src = Path(src)
    return (f"resume with the writer's layout ({writer.describe()}: set slurm.nodes/tasks_per_node and the deepspeed preset "
            f"back), or convert by hand: python -m swiftslurm.checkpoint.formats.ds_convert --input_folder "
            f"{src}/global_step<N> --output_folder {src}/global_step<N>_universal --inject_missing_state, then set "
            f'[deepspeed] checkpoint = {{load_universal = true}}; or start fresh in a new job.output_dir (not {output_dir})')


def sibling_dir(output_dir: Path | str, step: int) -> Path:
    return final_dir(Path(output_dir) / UNIVERSAL_DIR, step)


def reusable(sibling: Path, source_checksum: str) -> bool:
    """True when ``sibling`` verifies and was converted from the manifest with ``source_checksum``."""
    if not sibling.is_dir():
        return False
    result = verify(sibling)
    return result.ok and result.manifest is not None and result.manifest.meta.get("universal", {}).get("source_checksum") == source_checksum


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed
        shutil.copy2(src, dst)


_MP_STATES = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_ZERO3_STATES = re.compile(r"^zero_pp_rank_0_mp_rank_(\d+)_model_states\.pt$")


def _both_model_state_names(universal: Path) -> None:
    """A universal checkpoint loads on any ZeRO stage, but DeepSpeed finds its model-states file by the reader's
    stage: ``mp_rank_XX_model_states.pt`` at ZeRO-0/1/2, ``zero_pp_rank_0_mp_rank_XX_model_states.pt`` at ZeRO-3 (it
    reads only rank 0's, and with ``load_universal`` takes the weights from ``zero/``, not from this file: only the
    step counters, scheduler and client state). The tool keeps the writer's name, so a ZeRO-2 checkpoint failed on
    ZeRO-3 (``assert len(self.ckpt_list) > 0``) and the reverse: give the sibling both names (a hard link)."""
    for path in sorted(universal.glob("*_model_states.pt")):
        mp, z3 = _MP_STATES.match(path.name), _ZERO3_STATES.match(path.name)
        other = f"zero_pp_rank_0_mp_rank_{mp.group(1)}_model_states.pt" if mp else f"mp_rank_{z3.group(1)}_model_states.pt" if z3 else ""
        if other and not (universal / other).exists():
            _link_or_copy(path, universal / other)


def _stage3_optimizer_view(zero: Path) -> None:
    """The converted ZeRO-1/2 checkpoint's global optimizer state, made readable by ZeRO-3 as well. DeepSpeed's
    ZeRO-3 loader takes the Adam step and the param-group settings from ``optimizer_state_dict`` (what its own
    writer leaves there); ZeRO-1/2's layout keeps them in ``param_groups`` and each parameter's ``step.pt``. Added
    beside the rest, which ZeRO-1/2 still reads. The file is the tool's output from a checkpoint that passed the
    resume checks, read with torch's weights-only loader and DeepSpeed's two classes in it allowed."""
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    path = zero / "optimizer_state.pt"
    steps = sorted(zero.glob("*/step.pt"))
    if not path.is_file() or not steps:
        return  # nothing to add to: ZeRO-3's loader will say what it misses
    with torch.serialization.safe_globals([LossScaler, ZeroStageEnum]):
        state = torch.load(path, map_location="cpu", weights_only=True)
    step = torch.load(steps[0], map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "optimizer_state_dict" not in state and isinstance(state.get("param_groups"), list):
        state["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": state["param_groups"]}
        torch.save(state, path)


def converter_argv(global_step_dir: Path, out_folder: Path, workers: int = 1) -> list[str]:
    return [sys.executable, "-m", "swiftslurm.checkpoint.formats.ds_convert", "--input_folder", str(global_step_dir),
            "--output_folder", str(out_folder), "--inject_missing_state",
            "--num_extract_workers", str(workers), "--num_merge_workers", str(workers)]


def convert(src: Path | str, output_dir: Path | str, plan: LoadPlan, *, algo: str, timeout_s: float,
            log: Callable[[str], None] = print, workers: int = 1) -> tuple[Path, float]:
    """The verified universal sibling of checkpoint ``src`` (converted now, or reused): (path, seconds spent).

    Raises ``CheckpointNotConvertible`` naming DeepSpeed's error (or the timeout) and the manual way.
    """
    src = Path(src)
    started = time.perf_counter()
    manifest = read_manifest(src)
    step = manifest.step
    sibling = sibling_dir(output_dir, step)
    source_checksum = body_checksum(manifest.body())
    if reusable(sibling, source_checksum):
        log(f"swiftslurm: reusing the universal checkpoint {sibling} (converted earlier from {src.name})")
        return sibling, time.perf_counter() - started
    gs_name = f"global_step{step}"
    if not (src / gs_name).is_dir():
        raise CheckpointNotConvertible(f"cannot convert {src.name} to a universal checkpoint", f"{src}/{gs_name}: missing",
                                       manual_way(src, output_dir, plan.writer))
    staging = prepare_staging(sibling.parent, step)
    for rel in manifest.files:
        if not rel.startswith(gs_name + "/") and rel != "latest":
            _link_or_copy(src / rel, staging / rel)
    argv = converter_argv(src / gs_name, staging / f"{gs_name}_universal", workers)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise CheckpointNotConvertible(
            f"converting {src.name} to a universal checkpoint took longer than {timeout_s:g} s",
            f"{' '.join(argv[1:4])} ... still running (killed)",
            "raise checkpoint.convert_timeout_s, or " + manual_way(src, output_dir, plan.writer)) from None
    if proc.returncode != 0:
        tail = [line for line in (proc.stderr or proc.stdout).strip().splitlines() if line.strip()]
        raise CheckpointNotConvertible(
            f"DeepSpeed's universal-checkpoint tool could not convert {src.name} ({plan.writer.describe()} -> "
            f"{plan.reader.describe()})", (tail[-1] if tail else f"exit {proc.returncode}")[:400],
            manual_way(src, output_dir, plan.writer))
    _both_model_state_names(staging / f"{gs_name}_universal")
    if plan.writer.zero_stage in (1, 2):
        _stage3_optimizer_view(staging / f"{gs_name}_universal" / "zero")
    meta = {**manifest.meta, "step": step,
            "universal": {"source": str(src), "source_checksum": source_checksum,
                          "writer": _plain(plan.writer), "converted_for": _plain(plan.reader),
                          "convert_s": round(time.perf_counter() - started, 3)}}
    commit(staging, sibling, algo=algo, meta=meta)
    for other in sibling.parent.iterdir():  # only the newest conversion is ever loaded; a killed one left a staging dir
        name = other.name[len(STAGING_PREFIX):] if other.name.startswith(STAGING_PREFIX) else other.name
        ours = step_of(name) is not None  # checkpoint-N and its staging dirs: nothing else in universal/ is ours to delete
        if ours and other.is_dir() and not other.is_symlink() and other != sibling:
            shutil.rmtree(other, ignore_errors=True)
    return sibling, time.perf_counter() - started
