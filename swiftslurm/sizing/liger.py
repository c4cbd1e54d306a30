"""The model types Liger's kernels patch: a model of another type trains with its own layers however
``use_liger_kernel`` is set (Liger logs "no Liger kernels supported for model type ..." at info level and
does nothing), so neither the memory estimate nor the trainer's banner may count Liger there.

Liger keeps the list as the keys of ``MODEL_TYPE_TO_APPLY_LIGER_FN`` in
``liger_kernel/transformers/monkey_patch.py``. ``patched_model_types`` reads those keys from the installed
package's source (parsed, never imported: importing it loads torch and Triton, which ``plan`` does not need),
and falls back to ``KNOWN``, the list of liger-kernel 0.8.5, where liger-kernel is not installed or its file
has another shape. A type missing from ``KNOWN`` but patched by a newer Liger is then not counted: the
estimate is the larger one, never the smaller.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

from ..fsutil import CONFIG_CAP, Unreadable, read_text

TABLE = "MODEL_TYPE_TO_APPLY_LIGER_FN"
KNOWN = frozenset({
    "deepseek_v2", "deepseek_v3", "deepseek_v4", "exaone4", "falcon_h1", "gemma", "gemma2", "gemma3", "gemma3_text", "gemma4",
    "gemma4_text", "glm4", "glm4v", "glm4v_moe", "gpt_oss", "granite", "hunyuan_v1_dense", "hunyuan_v1_moe", "internvl", "llama",
    "llama4", "llama4_text", "llava", "ministral", "mistral", "mixtral", "mllama", "mllama_text_model", "muse_glimmer", "nemotron",
    "olmo2", "olmo3", "paligemma", "phi3", "pixtral", "qwen2", "qwen2_5_vl", "qwen2_5_vl_text", "qwen2_vl", "qwen2_vl_text",
    "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next", "qwen3_vl", "qwen3_vl_moe",
    "qwen3_vl_moe_text", "qwen3_vl_text", "smollm3", "smolvlm",
})

# the MoE types whose experts Liger's SwiGLU patch replaces with its fused experts (``LigerExperts``: the
# ``apply_liger_kernel_to_*`` functions of liger-kernel 0.8.5 that set it, under transformers 5); other MoE types it
# patches (gpt_oss, llama4) keep the model's own experts
FUSED_EXPERT_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "glm4v_moe", "hunyuan_v1_moe", "mixtral", "qwen3_5_moe", "qwen3_moe",
                                "qwen3_next", "qwen3_vl_moe"})


def table_keys(source: str) -> frozenset[str] | None:
    """The string keys of ``MODEL_TYPE_TO_APPLY_LIGER_FN = {...}`` in ``source``; None when it has no such dict."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    for node in tree.body:
        value: ast.expr | None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == TABLE for t in targets) and isinstance(value, ast.Dict):
            keys = frozenset(k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
            return keys or None
    return None


def installed_source() -> Path | None:
    """``liger_kernel/transformers/monkey_patch.py`` of the liger-kernel this Python imports; None without one."""
    try:
        spec = importlib.util.find_spec("liger_kernel")
    except (ImportError, ValueError):
        return None
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    found = [Path(r) / "transformers" / "monkey_patch.py" for r in roots]
    return next((p for p in found if p.is_file()), None)


@functools.cache
def _read(path: Path) -> frozenset[str] | None:
    try:
        return table_keys(read_text(path, CONFIG_CAP))
    except (OSError, Unreadable):
        return None


def patched_model_types(look: bool) -> frozenset[str]:
    """The model types Liger patches: the installed liger-kernel's own table where ``look`` (this reads its source),
    else (or where it cannot be read) ``KNOWN``."""
    path = installed_source() if look else None
    return (_read(path) if path is not None else None) or KNOWN


def patches(model_type: str | None, look: bool) -> bool:
    """Whether Liger's kernels apply to a model of ``model_type`` (None, unknown: not counted, the larger estimate)."""
    return model_type is not None and model_type in patched_model_types(look)
