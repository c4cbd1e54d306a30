"""The weights of an export, in memory: full weights (ZeRO shards gathered by DeepSpeed's ``zero_to_fp32``, else the
checkpoint's own model files) or a LoRA adapter merged into its base model (peft's ``merge_and_unload``).

Every ``torch.load`` here is weights-only (``checkpoint.formats.safeload``): a checkpoint file that would run code is
refused. torch and the model libraries are imported inside the functions: the login-side CLI imports this module's
callers without them.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable

from ..errors import CheckpointDamaged, SwiftSlurmError
from ..fsutil import CONFIG_CAP, Unreadable, read_json
from ..spec import TINY_MODELS
from .source import ADAPTER_CONFIG, Source

Log = Callable[[str], None]
TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class LibraryMissing(SwiftSlurmError):
    """The export runs here but the ``train`` extra (torch, transformers, ...) is not installed."""

    exit_code = 1


class ModelMisfit(SwiftSlurmError):
    """The checkpoint's weights do not fit the model they should load into."""

    exit_code = 2


def require_libraries(src: Source, merge: bool) -> None:
    """Every library this export loads imports here, or one error naming the missing ones and the way to install them."""
    needed = ["torch", "transformers", "safetensors"]
    needed += ["peft"] if src.lora and merge else []
    needed += ["deepspeed"] if gathers_zero(src) else []
    missing = []
    for name in needed:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
        if name == "torch" and not missing:
            from ..train.build import prepare_device_env

            prepare_device_env()  # DeepSpeed's CPU accelerator on a node without CUDA, chosen before it is imported
    if missing:
        raise LibraryMissing("export loads the model here, and its libraries are not installed", f"no {', '.join(missing)}",
                             "pip install 'swiftslurm[train]' on this machine, or export on a node that has it: --executor slurm")


def gathers_zero(src: Source) -> bool:
    """Full weights come from the ZeRO shards (the fp32 master weights) when the checkpoint has them."""
    return (not src.lora and src.zero_tag is not None and src.zero_stage in (1, 2, 3)
            and any((src.checkpoint / src.zero_tag).glob("*optim_states.pt")))


@contextlib.contextmanager
def _loading() -> Any:
    """Weights-only ``torch.load`` while loading (``require_libraries`` chose DeepSpeed's accelerator before)."""
    from ..checkpoint.formats.safeload import weights_only_loads

    with weights_only_loads():
        yield


def full_state(src: Source, log: Log) -> dict[str, Any]:
    """The full model's weights of a checkpoint: the ZeRO shards gathered to fp32, else its model files."""
    with _loading():
        if gathers_zero(src):
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            log(f"export: gathering the ZeRO-{src.zero_stage} shards of {src.zero_tag} (fp32 master weights)")
            return get_fp32_state_dict_from_zero_checkpoint(str(src.checkpoint), tag=src.zero_tag)
        from ..train.resume.weights import FULL, full_state_dict

        if not any((src.checkpoint / name).is_file() for name in FULL):
            raise CheckpointDamaged(f"{src.checkpoint} holds no full model weights", "no ZeRO shards, model.safetensors or pytorch_model.bin",
                                    "export a checkpoint of a run that saved its weights")
        log("export: reading the model files")
        try:
            return full_state_dict(src.checkpoint)
        except SwiftSlurmError:
            raise
        except (OSError, RuntimeError, ValueError) as exc:  # a file the libraries cannot parse
            raise CheckpointDamaged(f"the weights of {src.checkpoint} cannot be read", str(exc).splitlines()[0][:300],
                                    f"`swiftslurm verify {src.checkpoint}`") from None


def model_kind(src: Source) -> tuple[str, str]:
    """(the transformers Auto class, what it is in words) of the checkpoint's model: a reward model's score head is
    a sequence-classification model (one output), a model trained with a processor that takes images an
    image-text-to-text model, everything else a causal LM."""
    if src.score_head:
        return "AutoModelForSequenceClassification", "a sequence-classification model (a reward model's one score)"
    if src.takes_images:
        return "AutoModelForImageTextToText", "a vision-language model (image-text-to-text)"
    return "AutoModelForCausalLM", "a causal LM"


def full_model(src: Source, log: Log) -> Any:
    """The checkpoint's model (its own config.json) holding its full weights."""
    import torch
    import transformers

    state = full_state(src, log)
    auto, kind = model_kind(src)
    try:
        config = transformers.AutoConfig.from_pretrained(str(src.checkpoint), local_files_only=True)
        with torch.device("meta"):
            model = getattr(transformers, auto).from_config(config, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelMisfit(f"the config.json of {src.checkpoint} does not describe {kind} transformers can build",
                          str(exc).splitlines()[0][:300], f"export a checkpoint of {kind} of transformers") from None
    from ..train.resume.weights import model_names

    state = model_names(model, state)  # a file saved by transformers under other names (LLaVA's, an MoE's experts)
    _fit(model, state, str(src.checkpoint))
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    return model


def _fit(model: Any, state: dict[str, Any], where: str) -> None:
    own = model.state_dict()
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = [k for k in own if k not in state and not (tied and k.endswith("lm_head.weight"))]
    unexpected = [k for k in state if k not in own]
    shapes = [f"{k} {tuple(v.shape)} where the model has {tuple(own[k].shape)}" for k, v in state.items()
              if k in own and tuple(v.shape) != tuple(own[k].shape)]
    if missing or unexpected or shapes:
        raise ModelMisfit("the checkpoint's weights do not fit its config.json",
                          f"{where}: {len(missing)} missing ({', '.join(missing[:3])}), {len(unexpected)} unexpected "
                          f"({', '.join(unexpected[:3])}), {len(shapes)} of another shape ({'; '.join(shapes[:1])})",
                          "export a checkpoint written by one run (its config.json and weights together)")


def base_model(src: Source, log: Log) -> tuple[Any, Any]:
    """The model the adapter was trained on (train.model) and its processing class (tokenizer, or a vision-language
    model's processor), in fp32 (a merge's precision)."""
    import torch

    name = src.base_model
    if not name:
        raise ExportNeedsBase(f"cannot tell which model the adapter of {src.checkpoint} was trained on",
                              "no train.model in its manifest, no base_model_name_or_path in its adapter_config.json",
                              "pass --base-model (a hub id or a local model dir), or --adapter-only")
    log(f"export: loading the base model {name}")
    if name in TINY_MODELS:
        from ..train.tinymodel import build_model, build_processing
        from ..train.vision import tokenizer_of

        tok = build_processing(name)
        max_length, seed = src.fingerprint.get("train.max_length"), src.fingerprint.get("train.seed")
        if not isinstance(max_length, int) or not isinstance(seed, int):
            raise ExportNeedsBase(f"the {name} base is rebuilt from train.max_length and train.seed", "not in the manifest",
                                  "export a checkpoint written by swiftslurm's trainer")
        return build_model(len(tokenizer_of(tok)), max_length, seed, reward_head=src.score_head, name=name), tok
    import transformers

    auto, _kind = model_kind(src)
    head = {"num_labels": 1} if src.score_head else {}  # as the trainer loaded it (train/build.py); the head comes from the adapter
    try:
        # no Hub kernels swapped in (downloaded code; train/build.py says why): the plain layers merge and save
        model = getattr(transformers, auto).from_pretrained(name, dtype=torch.float32, local_files_only=True, use_kernels=False, **head)
        auto_processing = transformers.AutoProcessor if src.takes_images else transformers.AutoTokenizer
        return model, auto_processing.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ExportNeedsBase(f"cannot load the base model {name!r}", str(exc).splitlines()[0][:300],
                              "download it first (`huggingface-cli download ...` into HF_HOME), or pass --base-model DIR") from None


class ExportNeedsBase(SwiftSlurmError):
    exit_code = 2


def lora_config(src: Source) -> Any:
    from peft import LoraConfig

    try:
        raw = read_json(src.checkpoint / ADAPTER_CONFIG, CONFIG_CAP, wide_ints=True)
        return LoraConfig.from_peft_type(**{k: v for k, v in raw.items() if k != "peft_type"})
    except (OSError, Unreadable, TypeError, ValueError) as exc:
        raise CheckpointDamaged(f"the {ADAPTER_CONFIG} of {src.checkpoint} is not a LoRA config peft reads", str(exc)[:300],
                                "export a checkpoint written by swiftslurm's trainer or peft") from None


def merged_model(src: Source, log: Log) -> tuple[Any, Any]:
    """The base model with the checkpoint's LoRA adapter folded into its weights, and the base's tokenizer."""
    from peft import get_peft_model

    from ..train.resume.weights import load_adapter

    base, tok = base_model(src, log)
    model = get_peft_model(base, lora_config(src))
    lora_keys = {k for k in model.state_dict() if "lora_" in k}
    with _loading():
        loaded = _adapter_keys(src)
        load_adapter(model, src.checkpoint, "the checkpoint's adapter",
                     "the checkpoint's spec (its LoRA rank and target modules) is not the one that wrote these weights: "
                     "export a checkpoint written by swiftslurm's trainer, or fix the spec it carries")
    missing = sorted(k for k in lora_keys if _peft_key(k) not in loaded)
    if missing:
        raise ModelMisfit("the adapter does not cover the LoRA layers of its own config", f"{len(missing)} missing ({', '.join(missing[:3])})",
                          "export a checkpoint written by swiftslurm's trainer or peft")
    log("export: merging the LoRA adapter into the base weights")
    return model.merge_and_unload(), tok


def _peft_key(key: str) -> str:
    """A PeftModel state key as the saved adapter names it (no adapter name)."""
    return key.replace(".default.", ".").replace(".default", "")


def adapter_state(src: Source) -> dict[str, Any]:
    from .source import ADAPTER_FILES

    name = next(n for n in ADAPTER_FILES if (src.checkpoint / n).is_file())
    path = src.checkpoint / name
    with _loading():
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(str(path))
        import torch

        return torch.load(path, map_location="cpu", weights_only=True)


def _adapter_keys(src: Source) -> set[str]:
    return set(adapter_state(src))


def processing_of(src: Source) -> Any:
    """The tokenizer the run saved in the checkpoint (with its chat template), a vision-language model's processor
    (tokenizer and image processor), or None when it saved none."""
    if not (src.checkpoint / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoProcessor, AutoTokenizer

    try:
        return (AutoProcessor if src.takes_images else AutoTokenizer).from_pretrained(str(src.checkpoint), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CheckpointDamaged(f"the tokenizer files of {src.checkpoint} cannot be loaded", str(exc).splitlines()[0][:300],
                                "export a checkpoint written by swiftslurm's trainer") from None


def cast(model: Any, dtype: str) -> Any:
    import torch

    return model.to(getattr(torch, TORCH_DTYPES[dtype]))
