"""What a checkpoint directory we did not write holds, and whether its files are whole (read-only).

Kinds (``inspect_dir``):

- ``hf-trainer``: an HF Trainer ``checkpoint-N/`` (``trainer_state.json``), with DeepSpeed's
  ``global_stepN/`` shards and ``latest`` when DeepSpeed wrote it (``deepspeed`` in the facts), the
  per-rank ``rng_state_<r>.pth``, ``scheduler.pt``, and weights or an adapter;
- ``hf-model``: a plain model directory (``config.json`` and weights);
- ``peft-adapter``: a peft adapter directory (``adapter_config.json`` and adapter weights).

The checks read no tensor data: JSON files parse; a safetensors file's header parses and its size is
exactly header + the data its header describes; an index's every shard exists; a torch zip file
(``.pt``/``.pth``/``.bin``) has its central directory (a truncated copy does not); DeepSpeed's optimizer
shards cover ranks 0..N-1 and ``latest`` names a directory that exists. Facts (step, world size, ZeRO
stage, dtype) come from file names and JSON, and from the small header of DeepSpeed's model states file.
"""

from __future__ import annotations

import json
import re
import struct
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .manifest import MANIFEST_NAME, walk_files

KINDS = ("hf-trainer", "hf-model", "peft-adapter")
_OPTIM_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_ZERO3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_\d+_model_states\.pt$")
_RNG_RE = re.compile(r"^rng_state(?:_(\d+))?\.pth$")
_STEP_DIR_RE = re.compile(r"^global_step(\d+)$")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn"}


@dataclass
class Facts:
    """What ``inspect_dir`` found. ``problems`` empty = every check passed."""

    kind: str
    path: str
    step: int = 0
    world_size: int | None = None
    zero_stage: int | None = None
    dtype: str | None = None
    deepspeed: bool = False
    weights: str | None = None  # "full", "adapter", "deepspeed-shards" (only ZeRO shards), or None
    files: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class NotACheckpoint(ValueError):
    """The directory is none of the kinds we read; the message lists what it holds."""


def kind_of(names: set[str]) -> str | None:
    """The kind of a directory from its top-level names (pure); None when it is none we know."""
    if "trainer_state.json" in names:
        return "hf-trainer"
    if "adapter_config.json" in names:
        return "peft-adapter"
    if "config.json" in names and names & set(WEIGHT_FILES):
        return "hf-model"
    return None


def inspect_dir(path: Path | str) -> Facts:
    """Facts and problems of a foreign checkpoint dir. NotACheckpoint when its kind is unknown (or it is ours)."""
    path = Path(path)
    names = {p.name for p in path.iterdir()}
    if MANIFEST_NAME in names:
        raise NotACheckpoint("it has a manifest.json: a swiftslurm checkpoint already (`swiftslurm verify` checks it)")
    kind = kind_of(names)
    if kind is None:
        shown = ", ".join(sorted(names)[:8]) + (f", ... ({len(names)} entries)" if len(names) > 8 else "") if names else "an empty directory"
        raise NotACheckpoint(f"none of {', '.join(KINDS)}: it holds {shown}")
    facts = Facts(kind=kind, path=str(path))
    rels = walk_files(path)
    facts.files = len(rels)
    for rel in rels:
        _check_file(path, rel, facts)
    if kind == "hf-trainer":
        _trainer_facts(path, names, facts)
    facts.weights = facts.weights or _weights_kind(names)
    if kind == "peft-adapter" and not names & set(ADAPTER_FILES):
        facts.problems.append("adapter_model.safetensors: missing (an adapter_config.json without adapter weights)")
    if facts.dtype is None:
        facts.dtype = _config_dtype(path) or _weights_dtype(path, names)
    return facts


def _weights_kind(names: set[str]) -> str | None:
    if names & set(ADAPTER_FILES):
        return "adapter"
    if names & set(WEIGHT_FILES):
        return "full"
    return None


def _check_file(root: Path, rel: str, facts: Facts) -> None:
    p = root / rel
    try:
        size = p.stat().st_size
    except OSError as exc:
        facts.problems.append(f"{rel}: unreadable ({exc.strerror or exc})")
        return
    facts.bytes += size
    name = p.name
    if size == 0 and name != "latest":
        facts.problems.append(f"{rel}: empty file")
        return
    try:
        if name.endswith(".safetensors"):
            _check_safetensors(p, size)
        elif name.endswith(".json"):
            data = json.loads(p.read_text("utf-8"))
            if name.endswith(".index.json"):
                missing = sorted({f for f in (data.get("weight_map") or {}).values() if not (p.parent / f).is_file()})
                if missing:
                    facts.problems.append(f"{rel}: names {len(missing)} missing shard(s): {', '.join(missing[:3])}")
        elif name.endswith((".pt", ".pth", ".bin")):
            if zipfile.is_zipfile(p):
                with zipfile.ZipFile(p) as z:
                    z.namelist()
            else:  # torch's zip format since 1.6; an older pickle file or a truncated zip
                facts.problems.append(f"{rel}: not a whole torch file (no zip central directory: truncated or damaged)")
    except (OSError, ValueError, zipfile.BadZipFile, UnicodeDecodeError) as exc:
        facts.problems.append(f"{rel}: {exc}")


def _check_safetensors(p: Path, size: int) -> None:
    header, data_start = _safetensors_header(p)
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    if data_start + end != size:
        raise ValueError(f"{size} bytes, its header describes {data_start + end} (truncated or overwritten)")


def _safetensors_header(p: Path) -> tuple[dict, int]:
    with open(p, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError("not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise ValueError(f"not a safetensors file (header length {n})")
        header = json.loads(f.read(n).decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("not a safetensors file (header is not a JSON object)")
    return header, 8 + n


def _weights_dtype(root: Path, names: set[str]) -> str | None:
    for name in ("model.safetensors", "adapter_model.safetensors"):
        if name in names:
            try:
                header, _ = _safetensors_header(root / name)
            except (OSError, ValueError):
                return None
            kinds = sorted({v["dtype"] for k, v in header.items() if k != "__metadata__"})
            return "/".join(_SAFETENSORS_DTYPES.get(k, k.lower()) for k in kinds) or None
    return None


def _config_dtype(root: Path) -> str | None:
    try:
        config = json.loads((root / "config.json").read_text("utf-8"))
    except (OSError, ValueError):
        return None
    dtype = config.get("torch_dtype") or config.get("dtype") if isinstance(config, dict) else None
    return dtype if isinstance(dtype, str) else None


def _trainer_facts(root: Path, names: set[str], facts: Facts) -> None:
    try:
        state = json.loads((root / "trainer_state.json").read_text("utf-8"))
        facts.step = int(state["global_step"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        facts.problems.append(f"trainer_state.json: no global_step ({type(exc).__name__}: {exc})")
    rng_ranks = sorted(int(m.group(1) or 0) for n in names if (m := _RNG_RE.match(n)))
    if rng_ranks:
        facts.world_size = len(rng_ranks)
        if rng_ranks != list(range(len(rng_ranks))):
            facts.problems.append(f"rng_state_<rank>.pth: ranks {rng_ranks}, not 0..{len(rng_ranks) - 1} (a rank's file is missing)")
    step_dirs = sorted((int(m.group(1)), n) for n in names if (m := _STEP_DIR_RE.match(n)) and (root / n).is_dir())
    if not step_dirs:
        return
    facts.deepspeed = True
    tag = step_dirs[-1][1]
    if "latest" in names:
        tag = (root / "latest").read_text("utf-8", errors="replace").strip()
        if not (root / tag).is_dir():
            facts.problems.append(f"latest: names {tag!r}, which is not a directory here")
            return
    _deepspeed_facts(root, tag, facts)


def _deepspeed_facts(root: Path, tag: str, facts: Facts) -> None:
    shard_names = [p.name for p in (root / tag).iterdir()]
    optim = sorted(int(m.group(1)) for n in shard_names if (m := _OPTIM_RE.match(n)))
    zero3 = sorted(int(m.group(1)) for n in shard_names if (m := _ZERO3_MODEL_RE.match(n)))
    ranks = optim or zero3
    if ranks:
        if ranks != list(range(len(ranks))):
            facts.problems.append(f"{tag}: optimizer shards of ranks {ranks}, not 0..{len(ranks) - 1} (a rank's shard is missing)")
        if facts.world_size is not None and facts.world_size != len(ranks):
            facts.notes.append(f"{facts.world_size} rng states but {len(ranks)} data-parallel optimizer shards")
        facts.world_size = len(ranks)
    facts.zero_stage = 3 if zero3 else None
    facts.weights = facts.weights or _weights_kind({p.name for p in root.iterdir()}) or "deepspeed-shards"
    model_states = root / tag / ("mp_rank_00_model_states.pt" if not zero3 else "zero_pp_rank_0_mp_rank_00_model_states.pt")
    ds_config = _ds_config(model_states)
    if ds_config:
        stage = (ds_config.get("zero_optimization") or {}).get("stage")
        facts.zero_stage = int(stage) if isinstance(stage, int) else facts.zero_stage
        if (ds_config.get("bf16") or {}).get("enabled") is True:
            facts.dtype = "bfloat16"
        elif (ds_config.get("fp16") or {}).get("enabled") is True:
            facts.dtype = "float16"
    elif optim and facts.zero_stage is None:
        facts.notes.append("ZeRO stage 1 or 2 (the model states file did not say which)")
    if any(n.startswith("bf16_zero_pp_rank") for n in shard_names):
        facts.dtype = facts.dtype or "bfloat16"


def _ds_config(model_states: Path) -> dict | None:
    """The ds_config DeepSpeed stored in its model states file (memory-mapped: no tensor data is read)."""
    if not model_states.is_file() or not zipfile.is_zipfile(model_states):
        return None
    try:
        import torch

        state = torch.load(model_states, map_location="cpu", mmap=True, weights_only=False)
    except Exception:  # a foreign pickle may need classes we do not have; the stage is then unknown, not an error
        return None
    config = state.get("ds_config") if isinstance(state, dict) else None
    return config if isinstance(config, dict) else None
