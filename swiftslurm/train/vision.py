"""Vision-language models (issue 56), the model side: what differs when ``train.model`` has a vision tower.

A model is vision-language when its processing class is a processor with an image processor (``is_multimodal``):
``load_processing`` asks transformers' ``AutoProcessor`` first and keeps its answer only then, else the tokenizer.
The tiny one, ``tiny-vl``, is built in code (``tinymodel.py``). From there, behind the seams the trainer already has:

- ``fit_spec``: the task must train images (``swiftslurm/tasks.py``, ``images``); packing stays on for a model whose
  positions allow it (``PACKS``) and is turned off with its reason for the log otherwise, and sequence parallel is
  refused (its shards would split an image's tokens from the features placed on them);
- ``model_class``: the transformers Auto class (``AutoModelForImageTextToText``);
- ``freeze``: the vision tower (``train.freeze_vision``) and the projector (``train.freeze_projector``) kept out of
  training; a LoRA run trains adapters on the language model only (``lora_targets``), the rest frozen by peft;
- ``data/vision.py``: the records with images, decoded as the loader asks, and their packed rows or padded batches.

The vision tower is the model's image encoder (``get_encoder(modality="image")``, transformers 5); the projector the
first module of ``PROJECTORS`` the model has.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ..errors import SwiftSlurmError
from ..sizing.shape import target_names
from ..tasks import TASKS

if TYPE_CHECKING:
    from ..spec.model import JobSpec

# the module between the vision tower and the language model, by the names transformers gives it (LLaVA and most
# others; Qwen2-VL's merger sits inside its vision tower)
PROJECTORS = ("multi_modal_projector", "visual.merger", "mm_projector", "connector")
# Processors whose models train packed rows (train.packing): the image features are placed at the image tokens in the
# order they come, and each sample's positions restart in its row: 1-D (LLaVA), or Qwen2-VL's 3-D rotary positions,
# computed per sample by the model's own get_rope_index (data/vision.RopeIndex). Each has its own token count
# (``_get_num_multimodal_tokens``), which the rows are packed by. Not here: every processor not yet checked.
PACKS = {"LlavaProcessor": "LLaVA", "Qwen2VLProcessor": "Qwen2-VL", "Qwen2_5_VLProcessor": "Qwen2.5-VL"}
UNPACKED = ("off for this vision-language model ({name}): its positions in a packed row are not checked, so its "
            "micro-batches are padded (packed: " + ", ".join(PACKS.values()) + ")")


class VisionUnsupported(SwiftSlurmError):
    exit_code = 2


def is_multimodal(processing: Any) -> bool:
    """The processing class is a processor with an image processor: the model takes images."""
    return getattr(processing, "image_processor", None) is not None and getattr(processing, "tokenizer", None) is not None


def image_pair_problem(t: Any) -> str | None:
    """What DPO on preference pairs with images cannot take of ``t`` (train), in words, or None: TRL runs the
    processor per micro-batch there, so nothing is scored ahead (``precompute_ref_log_probs``) and the prompt is never
    tokenized apart to be cut (``max_prompt_length``). ``validate`` (``preference.count_records``) and the node
    (``tasks.dpo``) both ask."""
    keys = [k for k, on in (("precompute_ref_log_probs", t.precompute_ref_log_probs),
                            ("max_prompt_length", t.max_prompt_length is not None)) if on]
    if not keys:
        return None
    return (f"{' and '.join(keys)} with preference pairs that hold images: TRL processes each image pair per "
            "micro-batch, so nothing is scored ahead of training and the prompt is not cut apart")


def tokenizer_of(processing: Any) -> Any:
    """The tokenizer of a processing class (a processor's own, or the tokenizer itself)."""
    return processing.tokenizer if is_multimodal(processing) else processing


def load_processing(name: str, local_only: bool) -> Any:
    """``name``'s processor when it has an image processor, else its tokenizer (transformers' Auto classes). A
    processor that needs a package this node lacks (Qwen2-VL's needs torchvision) raises ImportError naming it."""
    from transformers import AutoProcessor, AutoTokenizer, PreTrainedTokenizerBase

    try:
        processor = AutoProcessor.from_pretrained(name, local_files_only=local_only)
    except (OSError, ValueError, KeyError):  # no processor files: a text model's tokenizer alone
        processor = None
    if is_multimodal(processor) or isinstance(processor, PreTrainedTokenizerBase):
        return processor  # a text model's AutoProcessor answer is its tokenizer: not loaded a second time
    return AutoTokenizer.from_pretrained(name, local_files_only=local_only)


def model_class(processing: Any, score_head: bool) -> str:
    """The transformers Auto class that loads the model of this processing class."""
    if score_head:
        return "AutoModelForSequenceClassification"
    return "AutoModelForImageTextToText" if is_multimodal(processing) else "AutoModelForCausalLM"


def fit_spec(spec: JobSpec, processing: Any) -> tuple[JobSpec, str | None]:
    """(the spec this run trains with, the line the log gives it): a text model's spec as it is; a vision-language
    model's as it is where it packs (``packs``), else with packing off (and the reason), or VisionUnsupported where
    the task or parallelism cannot take it."""
    if not is_multimodal(processing):
        return spec, None
    t = spec.train
    found = f"train.model = {t.model!r} takes images ({type(processing).__name__})"
    if not TASKS[t.task].images:
        able = ", ".join(repr(n) for n, row in TASKS.items() if row.images)
        raise VisionUnsupported(f"train.task = {t.task!r} does not train vision-language models yet", found,
                                f"use task = {able}, or a text model for {t.task!r}")
    if spec.parallel.sequence_parallel > 1:
        raise VisionUnsupported("sequence parallel does not train vision-language models", found,
                                "set parallel.sequence_parallel = 1 (an image's tokens must stay on one rank)")
    if not t.packing or packs(processing):
        return spec, None
    return (spec.model_copy(update={"train": t.model_copy(update={"packing": False})}),
            f"packing {UNPACKED.format(name=type(processing).__name__)}")


def packs(processing: Any) -> bool:
    """This vision-language processor's model trains packed rows (``PACKS``)."""
    return type(processing).__name__ in PACKS and hasattr(processing, "_get_num_multimodal_tokens")


def is_vision_language(model: Any) -> bool:
    """The model has a vision tower: its config carries a ``vision_config`` (every transformers VLM's does)."""
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


def _prefix(model: Any, module: Any) -> str | None:
    return next((name for name, m in model.named_modules() if m is module), None) if module is not None else None


def parts(model: Any) -> tuple[str | None, str | None, str | None]:
    """The names of (vision tower, projector, language model) in ``model``, each None where it has none."""
    if not is_vision_language(model):
        return None, None, None
    tower = model.get_encoder(modality="image")
    modules = dict(model.named_modules())
    projector = next((name for name in modules for p in PROJECTORS if name == p or name.endswith("." + p)), None)
    return _prefix(model, tower), projector, _prefix(model, model.get_decoder())


def freeze(model: Any, freeze_vision: bool, freeze_projector: bool) -> dict[str, int]:
    """Parameters of the vision tower and the projector out of training (``requires_grad`` False) as the flags say;
    returns the parameters frozen by part. A text model: nothing."""
    tower, projector, _ = parts(model)
    frozen = {"vision": 0, "projector": 0}
    for name, param in model.named_parameters():
        part = ("projector" if projector and name.startswith(projector + ".")
                else "vision" if tower and name.startswith(tower + ".") else None)
        if part is not None and (freeze_vision if part == "vision" else freeze_projector):
            param.requires_grad_(False)
            frozen[part] += param.numel()
    return frozen


def lora_targets(model: Any, targets: str | list[str]) -> str | list[str]:
    """``train.lora_target_modules`` for peft: a text model's as written; a vision-language model's limited to the
    language model's linear layers (a regex peft matches against whole module names): ``all-linear`` = every one of
    them but the LM head, a list = those of its names."""
    import torch

    _, _, language = parts(model)
    if language is None:
        return targets
    names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
             if name.startswith(language + ".") and isinstance(m, torch.nn.Linear)}
    listed = target_names(targets)
    wanted = sorted(names if listed is None else {t.rsplit(".", 1)[-1] for t in listed})
    return rf"{re.escape(language)}\..*\.({'|'.join(map(re.escape, wanted))})"
