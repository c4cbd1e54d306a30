"""Load only the weights of a checkpoint into a freshly built model (``train.resume_weights_only``).

Full weights come from ``model.safetensors`` / ``pytorch_model.bin`` (or their sharded index), else from
DeepSpeed's ZeRO shards (``zero_to_fp32``); a LoRA adapter from ``adapter_model.safetensors`` / ``.bin``.
A checkpoint whose weights do not fit the model (other names or shapes) is one clear error, never a
silent partial load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...errors import RuntimeEnvError
from ...fsutil import CONFIG_CAP, is_inside, read_json

FULL = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
ADAPTER = ("adapter_model.safetensors", "adapter_model.bin")


def has_full(ckpt: Path) -> bool:
    return any((ckpt / n).is_file() for n in FULL) or any(ckpt.glob("global_step*/*model_states.pt"))


def has_adapter(ckpt: Path) -> bool:
    return any((ckpt / n).is_file() for n in ADAPTER)


def _read(path: Path) -> dict[str, Any]:
    if path.name.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(str(path))
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def _index_shards(ckpt: Path, index: Path) -> list[str]:
    """The shard files a weights index names, each a file inside ``ckpt``; RuntimeEnvError otherwise."""
    try:
        weight_map = read_json(index, CONFIG_CAP, wide_ints=True).get("weight_map")
    except (OSError, ValueError) as exc:  # Unreadable names the file and why
        raise RuntimeEnvError("the checkpoint's weights index cannot be read", str(exc), "copy the checkpoint again") from None
    shards = sorted(set(weight_map.values())) if isinstance(weight_map, dict) else []
    if not shards or not all(isinstance(s, str) and s and is_inside(ckpt, ckpt / s) for s in shards):
        raise RuntimeEnvError("the checkpoint's weights index names no shard files inside the checkpoint", str(index),
                              "copy the checkpoint again, or point at the model directory it came from")
    return shards


def full_state_dict(ckpt: Path) -> dict[str, Any]:
    for name in FULL:
        p = ckpt / name
        if not p.is_file():
            continue
        if name.endswith(".index.json"):
            shards = _index_shards(ckpt, p)
            out: dict[str, Any] = {}
            for shard in shards:
                out.update(_read(ckpt / shard))
            return out
        return _read(p)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(ckpt))


def model_names(model: Any, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (read from a model file) under ``model``'s own parameter names. transformers' ``save_pretrained``
    writes some models under other names than their module tree's (LLaVA's ``language_model.model.*``, a Qwen3-MoE's
    experts one by one where the model holds them fused) and its ``from_pretrained`` converts them back; a state read
    here straight from ``model.safetensors`` goes through the same conversion (``from_pretrained`` given the state)
    when its names are not the model's. Where that conversion does not account for every weight both ways, ``state``
    comes back as read, for the caller's misfit error. The conversion holds a second copy of the weights meanwhile."""
    own = model.state_dict()
    if set(state) <= set(own):
        return state
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return state
    from ..tinymodel import built_whole

    dtype = next((t.dtype for t in own.values() if t.is_floating_point()), None)
    try:
        with built_whole():  # a plain model: no ZeRO-3 partitioning while a live config would ask for it
            loaded: Any = type(model).from_pretrained(None, config=model.config, state_dict=state, dtype=dtype,
                                                      output_loading_info=True)
            converted, info = loaded
    except (OSError, ValueError, RuntimeError, KeyError, TypeError):
        return state
    if any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")):
        return state
    return converted.state_dict()


def load_full(model: Any, ckpt: Path, train_type: str) -> None:
    """Full weights into ``model`` (before LoRA wraps it). An adapter-only checkpoint: nothing here for LoRA
    (``load_adapter`` follows), an error for full fine-tuning."""
    has_weights = any((ckpt / n).is_file() for n in FULL) or (not has_adapter(ckpt) and has_full(ckpt))
    if not has_weights:
        if has_adapter(ckpt) and train_type == "lora":
            return
        raise RuntimeEnvError(
            "train.resume_from holds no full model weights to start from",
            f"{ckpt}: " + ("a LoRA adapter only" if has_adapter(ckpt) else "no model.safetensors, pytorch_model.bin or ZeRO shards"),
            "for an adapter, set train.train_type = \"lora\" with the model it was trained on; else point train.resume_from "
            "at a checkpoint with weights")
    state = model_names(model, full_state_dict(ckpt))
    own = model.state_dict()
    shapes = [f"{k} {tuple(v.shape)} where the model has {tuple(own[k].shape)}" for k, v in state.items()
              if k in own and tuple(v.shape) != tuple(own[k].shape)]
    if shapes:
        raise RuntimeEnvError("the weights of train.resume_from do not fit train.model",
                              f"{ckpt}: {len(shapes)} weight(s) of another shape, first {shapes[0]}",
                              "start from a checkpoint of the same model (train.model as when it was trained)")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    missing = [k for k in missing if not (tied and k.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise RuntimeEnvError(
            "the weights of train.resume_from do not fit train.model",
            f"{ckpt}: {len(missing)} of the model's weights missing ({', '.join(missing[:3])}), "
            f"{len(unexpected)} unexpected ({', '.join(unexpected[:3])})",
            "start from a checkpoint of the same model (train.model as when it was trained)")


def load_adapter(model: Any, ckpt: Path, what: str = "the adapter of train.resume_from",
                 hint: str = "use the lora_rank, lora_alpha and lora_target_modules it was trained with") -> None:
    """An adapter's weights into the peft ``model`` (after LoRA wrapped it); a no-op without an adapter. ``what`` and
    ``hint`` name the adapter and the way out for the caller (a resume, an export) in the refusal."""
    name = next((n for n in ADAPTER if (ckpt / n).is_file()), None)
    if name is None:
        return
    from peft import set_peft_model_state_dict

    try:
        result = set_peft_model_state_dict(model, _read(ckpt / name))
    except RuntimeError as exc:  # shapes: another lora_rank or target modules
        raise RuntimeEnvError(f"{what} does not fit this LoRA setup", f"{ckpt / name}: {str(exc).splitlines()[0][:300]}",
                              hint) from None
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise RuntimeEnvError(f"{what} does not fit this LoRA setup",
                              f"{ckpt / name}: {len(unexpected)} unexpected weights ({', '.join(unexpected[:3])})", hint)
