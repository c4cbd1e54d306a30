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

Everything here is data we did not write: files are read through ``fsutil`` (regular files only, capped,
bounded JSON), DeepSpeed's state only with ``torch.load(weights_only=True)`` (no code runs; the ZeRO stage
stays unknown when that fails), and every path the checkpoint names or links to (a symlink, ``latest``, an
index's ``weight_map``) must stay inside it, else ``Outside`` names it.
"""

from __future__ import annotations

import os
import re
import stat
import struct
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ...fsutil import CONFIG_CAP, TAG_CAP, Unreadable, file_kind, is_inside, loads_json, open_regular, read_json, read_text
from ..manifest import MANIFEST_NAME

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


class Outside(Exception):
    """A path the checkpoint holds or names leads outside it (a symlink, ``latest``, a ``weight_map`` entry),
    or a symlinked directory is reached twice (a loop): the message names it. Never imported."""


def source_files(root: Path | str) -> list[str]:
    """Every file under ``root`` as a sorted POSIX relative path, following symlinks that stay inside ``root``
    (a symlinked ``global_step*/`` is walked like a directory, so what is reported is what is copied).
    Outside for a symlink that leaves ``root`` (or dangles), and for a directory reached twice (a loop)."""
    root = Path(root)
    real_root = root.resolve()
    seen = {real_root}
    out: list[str] = []
    stack = [(root, "")]
    while stack:
        here, prefix = stack.pop()
        with os.scandir(here) as entries:
            for entry in entries:
                rel = prefix + entry.name
                path = Path(entry.path)
                if entry.is_symlink():
                    target = os.readlink(path)
                    if not path.exists() or not is_inside(real_root, path):
                        raise Outside(f"{rel}: a symlink to {target}, outside the checkpoint")
                if entry.is_dir():  # follows a symlink: checked above to stay inside
                    real = path.resolve()
                    if real in seen:
                        raise Outside(f"{rel}: a directory reached twice through a symlink (a loop, or a second name for {real.name})")
                    seen.add(real)
                    stack.append((path, rel + "/"))
                else:
                    out.append(rel)
    return sorted(out)


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
    rels = source_files(path)
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
        st = p.stat()
    except OSError as exc:
        facts.problems.append(f"{rel}: unreadable ({exc.strerror or exc})")
        return
    if not stat.S_ISREG(st.st_mode):
        facts.problems.append(f"{rel}: {file_kind(st.st_mode)}, not a regular file")
        return
    size = st.st_size
    facts.bytes += size
    name = p.name
    if size == 0 and name != "latest":
        facts.problems.append(f"{rel}: empty file")
        return
    try:
        if name.endswith(".safetensors"):
            _check_safetensors(p, size)
        elif name.endswith(".json"):
            data = read_json(p, CONFIG_CAP, expect=None, wide_ints=True)
            if name.endswith(".index.json"):
                _check_index(root, rel, data, facts)
        elif name.endswith((".pt", ".pth", ".bin")):
            with open_regular(p) as fh:  # never a FIFO or device under a torch file's name
                whole = zipfile.is_zipfile(fh)
                if whole:
                    with zipfile.ZipFile(fh) as z:
                        z.namelist()
            if not whole:  # torch's zip format since 1.6; an older pickle file or a truncated zip
                facts.problems.append(f"{rel}: not a whole torch file (no zip central directory: truncated or damaged)")
    except Unreadable as exc:
        facts.problems.append(f"{rel}: {exc.why}")
    except (OSError, ValueError, zipfile.BadZipFile, UnicodeDecodeError) as exc:
        facts.problems.append(f"{rel}: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}")


def _check_index(root: Path, rel: str, data: Any, facts: Facts) -> None:
    """An index's ``weight_map`` (tensor name -> shard file): every shard inside the checkpoint and present."""
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        facts.problems.append(f"{rel}: damaged: its weight_map is not an object of tensor name -> shard file")
        return
    parent = (root / rel).parent
    for shard in sorted(set(weight_map.values())):
        if not shard or not is_inside(root, parent / shard):
            raise Outside(f"{rel}: its weight_map names {shard!r}, outside the checkpoint")
    missing = sorted(f for f in set(weight_map.values()) if not (parent / f).is_file())
    if missing:
        facts.problems.append(f"{rel}: names {len(missing)} missing shard(s): {', '.join(missing[:3])}")


def _check_safetensors(p: Path, size: int) -> None:
    header, data_start = _safetensors_header(p)
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if data_start + end != size:
        raise ValueError(f"{size} bytes, its header describes {data_start + end} (truncated or overwritten)")


def _safetensors_header(p: Path) -> tuple[dict, int]:
    """The header of a safetensors file, checked for shape; ValueError "damaged: why" otherwise."""
    with open_regular(p) as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError("not a safetensors file (shorter than its header length)")
        (n,) = struct.unpack("<Q", raw)
        if n > CONFIG_CAP:
            raise ValueError(f"damaged: a safetensors header length of {n} bytes (over {CONFIG_CAP >> 20} MiB)")
        raw = f.read(n)
    if len(raw) < n:
        raise ValueError(f"damaged: the file ends inside its {n}-byte safetensors header")
    try:
        header = loads_json(raw)
    except Unreadable as exc:
        raise ValueError(f"damaged: its safetensors header is {exc.why}") from None
    why = _header_shape_problem(header)
    if why:
        raise ValueError(f"damaged: {why}")
    return header, 8 + n


def _header_shape_problem(header: Any) -> str | None:
    """What is wrong with the shape of a safetensors header (pure), or None."""
    if not isinstance(header, dict):
        return "its safetensors header is not a JSON object"
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict):
                return "its safetensors __metadata__ is not a JSON object"
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
            return f"tensor {name[:80]!r} in its safetensors header has no dtype"
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            return f"tensor {name[:80]!r} in its safetensors header has no shape of whole numbers"
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            return f"tensor {name[:80]!r} in its safetensors header has no data_offsets [begin, end]"
    return None


def _weights_dtype(root: Path, names: set[str]) -> str | None:
    for name in ("model.safetensors", "adapter_model.safetensors"):
        if name in names:
            try:
                header, _ = _safetensors_header(root / name)
            except (OSError, ValueError):  # Unreadable is a ValueError
                return None
            kinds = sorted({v["dtype"] for k, v in header.items() if k != "__metadata__"})
            return "/".join(_SAFETENSORS_DTYPES.get(k, k.lower()) for k in kinds) or None
    return None


def _config_dtype(root: Path) -> str | None:
    try:
        config = read_json(root / "config.json", CONFIG_CAP, wide_ints=True)
    except (OSError, ValueError):
        return None
    dtype = config.get("torch_dtype") or config.get("dtype") if isinstance(config, dict) else None
    return dtype if isinstance(dtype, str) else None


def _trainer_facts(root: Path, names: set[str], facts: Facts) -> None:
    try:
        step = read_json(root / "trainer_state.json", CONFIG_CAP, wide_ints=True)["global_step"]
        if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step < 1 << 63:
            raise ValueError(f"{step!r} is not a step number")
        facts.step = step
    except Unreadable as exc:
        facts.problems.append(f"trainer_state.json: no global_step ({exc.why})")
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
        try:
            tag = read_text(root / "latest", TAG_CAP, errors="replace").strip()
        except (OSError, ValueError) as exc:
            facts.problems.append(f"latest: {exc.why if isinstance(exc, Unreadable) else exc}")
            return
        if not tag or not is_inside(root, root / tag) or (root / tag).resolve() == root.resolve():
            raise Outside(f"latest: names {tag[:200]!r}, outside the checkpoint's own directories")
        if not (root / tag).is_dir():
            facts.problems.append(f"latest: names {tag[:200]!r}, which is not a directory here")
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
        stage = _section(ds_config, "zero_optimization").get("stage")
        facts.zero_stage = stage if isinstance(stage, int) and not isinstance(stage, bool) and 0 <= stage <= 3 else facts.zero_stage
        if _section(ds_config, "bf16").get("enabled") is True:
            facts.dtype = "bfloat16"
        elif _section(ds_config, "fp16").get("enabled") is True:
            facts.dtype = "float16"
    elif optim and facts.zero_stage is None:
        facts.notes.append("ZeRO stage 1 or 2 (the model states file did not say which)")
    if any(n.startswith("bf16_zero_pp_rank") for n in shard_names):
        facts.dtype = facts.dtype or "bfloat16"


def _section(config: dict, key: str) -> dict:
    value = config.get(key)
    return value if isinstance(value, dict) else {}


def _ds_config(model_states: Path) -> dict | None:
    """The ds_config DeepSpeed stored in its model states file (memory-mapped: no tensor data is read).

    ``weights_only=True``: tensors and plain containers only, a class in the pickle is refused (it would run
    code). A file that needs more, or whose pickle is over ``CONFIG_CAP``, leaves the stage unknown."""
    try:
        with open_regular(model_states) as fh:  # never a FIFO or device under the states' name
            if not zipfile.is_zipfile(fh):
                return None
    except OSError:
        return None
    try:
        with zipfile.ZipFile(model_states) as z:
            if any(i.filename.endswith("data.pkl") and i.file_size > CONFIG_CAP for i in z.infolist()):
                return None
        import torch

        state = torch.load(model_states, map_location="cpu", mmap=True, weights_only=True)
    except Exception:  # noqa: BLE001 -- foreign, hostile or torn: the stage is then unknown, not an error
        return None
    config = state.get("ds_config") if isinstance(state, dict) else None
    return config if isinstance(config, dict) else None
