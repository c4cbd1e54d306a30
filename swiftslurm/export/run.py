"""One export, here, in this process: SOURCE -> a verified checkpoint -> the model dir at ``--to``."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from .source import DTYPES, ExportRefused, Source, find_source, shard_bytes
from .write import DEFAULT_SHARD, Exported, check_target, write_export

Log = Callable[[str], None]


def weights_kind(src: Source, adapter_only: bool) -> str:
    """merged-lora (a LoRA run, by default), adapter (``--adapter-only``) or full (pure)."""
    if adapter_only and not src.lora:
        raise ExportRefused("--adapter-only needs a LoRA checkpoint", f"{src.checkpoint} holds full weights (no adapter_model.*)",
                            "leave out --adapter-only: the full weights are exported")
    return ("adapter" if adapter_only else "merged-lora") if src.lora else "full"


def dtype_for(src: Source, dtype: str) -> str:
    """``auto`` = what the run trained in (pure)."""
    if dtype == "auto":
        return src.train_dtype
    if dtype not in DTYPES:
        raise ExportRefused(f"unknown --dtype {dtype!r}", dtype, "use bf16, fp16, fp32 or auto")
    return dtype


def export_here(source: str, to: Path, *, task: int | None = None, adapter_only: bool = False, dtype: str = "auto",
                max_shard_size: str = DEFAULT_SHARD, base_model: str | None = None, log: Log = lambda _m: None) -> Exported:
    """Verify, load, gather or merge, and write (see the package). Raises SwiftSlurmError for people."""
    from .weights import require_libraries

    to = Path(to).absolute()
    shard_bytes(max_shard_size)  # refused before anything is hashed or loaded
    check_target(to, Path(source).absolute())  # a non-empty --to is refused before anything is hashed or loaded
    src = find_source(source, task, base_model, log)
    kind = weights_kind(src, adapter_only)
    chosen = dtype_for(src, dtype)
    require_libraries(src, merge=kind == "merged-lora")
    return write_export(src, to, chosen, kind, max_shard_size, log)
