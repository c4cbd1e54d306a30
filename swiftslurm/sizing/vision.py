"""Images in the sequence (pure): how many tokens an image takes, and the vision tower's activation memory.

Tokens: a Qwen2-VL-like processor resizes an image so that its sides are multiples of 28 and its area lies in
[min_pixels, max_pixels] (``smart_resize`` in transformers' ``image_processing_qwen2_vl.py``), cuts it into 14 x 14
patches for the vision tower and merges each 2 x 2 of them into one language-model token: (h / 14)(w / 14) / 4
tokens. An image therefore takes at most ``max_pixels // PIXELS_PER_IMAGE_TOKEN`` tokens of the sequence, and those
tokens count against ``train.max_length`` like text. Processors of fixed resolution (LLaVA's CLIP: every image
resized to one square, ``(size / patch)^2`` tokens, a patch a token) take a constant instead. ``token_rule`` says
which a spec's model follows (``TokenRule``): LLaVA where the plan can tell (the built-in ``tiny-vl``, a local
directory whose config.json says ``llava``), else Qwen2-VL's, the bound ``train.image_max_pixels`` promises.

Memory: the image tokens are inside ``max_length``, so the language model's activations (``memory.py``) already
count them. What they do not count is the vision tower, which runs over the patches (4 a token) before the
language model: with the tower frozen (``train.freeze_vision``, the default) no activation is kept for a backward
and one layer's work is held at a time; trained, every layer keeps its activations. The tower's shape comes from
the model's ``vision_config`` where the plan can read it, else ``ASSUMED_TOWER`` (Qwen2-VL's and Qwen2.5-VL's ViT),
and the plan says which.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .memory import ACT_HIDDEN_TERMS, ACT_INTERMEDIATE_TERMS, RESIDUAL_TERMS

PATCH_SIDE = 14  # a vision-tower patch: 14 x 14 pixels (Qwen2-VL, Qwen2.5-VL)
MERGE_SIDE = 2  # 2 x 2 patches merged into one language-model token (Qwen2-VL's PatchMerger)
RESIZE_FACTOR = PATCH_SIDE * MERGE_SIDE  # 28: an image's sides are resized to multiples of this
PIXELS_PER_IMAGE_TOKEN = RESIZE_FACTOR * RESIZE_FACTOR  # 784 = 28 x 28 pixels of the image a token
PATCHES_PER_TOKEN = MERGE_SIDE * MERGE_SIDE
MAX_ASPECT = 200  # smart_resize refuses an image more than 200 times as wide as high (or as high as wide)


def resized(width: int, height: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(width, height) a Qwen2-VL-like processor resizes an image to: sides multiples of ``RESIZE_FACTOR``, the area
    brought into [min_pixels, max_pixels] keeping the aspect ratio (transformers' ``smart_resize``)."""
    f = RESIZE_FACTOR
    h, w = max(f, round(height / f) * f), max(f, round(width / f) * f)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    return w, h


def image_tokens(width: int, height: int, min_pixels: int, max_pixels: int) -> int:
    """Language-model tokens one image of ``width`` x ``height`` pixels takes in the sequence (Qwen2-VL's resizing)."""
    w, h = resized(width, height, min_pixels, max_pixels)
    return w * h // PIXELS_PER_IMAGE_TOKEN


def max_image_tokens(max_pixels: int) -> int:
    """The most tokens one image takes at ``train.image_max_pixels`` (at least one; Qwen2-VL's resizing)."""
    return max(1, max_pixels // PIXELS_PER_IMAGE_TOKEN)


@dataclass(frozen=True)
class TokenRule:
    """How many language-model tokens an image takes for one model: Qwen2-VL's resizing (``fixed`` None: the pixel
    bounds decide), or a fixed count (LLaVA: every image resized to one square). ``source`` says which and why:
    ``words``, after ``where`` they were read (a config.json, the built-in model's name) when there is one."""

    fixed: int | None = None
    patches_per_token: int = PATCHES_PER_TOKEN  # vision-tower patches behind one token (the tower's activations)
    words: str = (f"{PIXELS_PER_IMAGE_TOKEN} pixels a token: {PATCH_SIDE} x {PATCH_SIDE} patches merged {MERGE_SIDE} x "
                  f"{MERGE_SIDE}, Qwen2-VL-like")
    where: str = ""

    @property
    def source(self) -> str:
        return f"{self.where}: {self.words}" if self.where else self.words

    def tokens(self, width: int, height: int, min_pixels: int, max_pixels: int) -> int:
        return self.fixed if self.fixed is not None else image_tokens(width, height, min_pixels, max_pixels)

    def most(self, max_pixels: int) -> int:
        return self.fixed if self.fixed is not None else max_image_tokens(max_pixels)

    def fewest(self, min_pixels: int, max_pixels: int) -> int:
        return self.fixed if self.fixed is not None else max(1, math.ceil(min(min_pixels, max_pixels) / PIXELS_PER_IMAGE_TOKEN))

    def bound_problem(self, max_pixels: int, max_length: int) -> tuple[str, str] | None:
        """(why, hint) when one image cannot fit a sample of ``max_length`` tokens, or None when it can."""
        tokens = self.most(max_pixels)
        if tokens <= max_length:
            return None
        if self.fixed is not None:
            return (f"every image takes {tokens:,} tokens ({self.source}), more than train.max_length = {max_length:,}: "
                    "truncation would cut the image's tokens off", f"raise train.max_length to at least {tokens + 1:,}")
        return (f"train.image_max_pixels = {max_pixels:,} lets one image take up to {tokens:,} tokens "
                f"({PIXELS_PER_IMAGE_TOKEN} pixels a token), more than train.max_length = {max_length:,}: truncation would "
                "cut the image's tokens off",
                f"lower train.image_max_pixels to at most {max_length * PIXELS_PER_IMAGE_TOKEN:,}, or raise train.max_length")


QWEN_RULE = TokenRule()
LLAVA_TYPES = ("llava",)  # config.json model_type of the LLaVA-1.5 form: one square crop, a patch a token
TINY_VL_TOKENS = 4  # tiny-vl (train/tinymodel.py): 28 x 28 pixels in 14 x 14 patches, the CLS feature dropped


def llava_rule(config: dict[str, Any], where: str) -> TokenRule | None:
    """LLaVA's fixed count from a config.json (``model_type`` "llava": ``(image_size / patch_size)^2`` patches, one more
    with ``vision_feature_select_strategy = "full"``, which keeps the CLS feature), or None for another model."""
    vc = config.get("vision_config")
    if config.get("model_type") not in LLAVA_TYPES or not isinstance(vc, dict):
        return None
    side, patch = vc.get("image_size"), vc.get("patch_size")
    if not (isinstance(side, int) and isinstance(patch, int) and 0 < patch <= side):
        return None
    tokens = (side // patch) ** 2 + (1 if config.get("vision_feature_select_strategy") == "full" else 0)
    return TokenRule(tokens, 1, f"LLaVA, every image {side} x {side} pixels in {patch} x {patch} patches, a patch a token", where)


def token_rule(model: str | None) -> TokenRule:
    """The ``TokenRule`` of ``train.model``: the built-in ``tiny-vl``'s, a local LLaVA directory's (``llava_rule``),
    else Qwen2-VL's (a hub id, or a config that says otherwise or cannot be read: ``local_config``)."""
    if model == "tiny-vl":
        return TokenRule(TINY_VL_TOKENS, 1, "every image 28 x 28 pixels in 14 x 14 patches, a patch a token", "tiny-vl")
    found = local_config(model)
    return (llava_rule(*found) if found else None) or QWEN_RULE


@dataclass(frozen=True)
class VisionTower:
    """What the activation estimate needs of a vision tower; ``source`` says where it came from."""

    hidden_size: int
    depth: int
    intermediate_size: int
    source: str


# Qwen2-VL's ViT (Qwen2.5-VL's has the same width and depth): 1280 wide, 32 layers, MLP 4 x 1280
ASSUMED_TOWER = VisionTower(1280, 32, 5120, "assumed: Qwen2-VL's vision tower, 1280 wide, 32 layers")


def tower_from_config(config: dict[str, Any], where: str) -> VisionTower | None:
    """The vision tower of a transformers ``config.json``'s ``vision_config`` (Qwen2-VL: ``embed_dim``, ``depth``,
    ``mlp_ratio``; Qwen2.5-VL: ``hidden_size``, ``depth``, ``intermediate_size``; LLaVA's CLIP: ``hidden_size``,
    ``num_hidden_layers``, ``intermediate_size``), or None when it has none of these."""
    vc = config.get("vision_config")
    if not isinstance(vc, dict):
        return None
    width = vc.get("embed_dim") if isinstance(vc.get("embed_dim"), int) else vc.get("hidden_size")
    depth = vc.get("depth", vc.get("num_hidden_layers"))
    if not (isinstance(width, int) and isinstance(depth, int) and width > 0 and depth > 0):
        return None
    inter = vc.get("intermediate_size")
    if not isinstance(inter, int) or inter <= 0:
        ratio = vc.get("mlp_ratio", 4)
        inter = int(width * ratio) if isinstance(ratio, (int, float)) and ratio > 0 else 4 * width
    return VisionTower(width, depth, inter, f"{where}: vision_config, {width} wide, {depth} layers")


# per patch and layer, in elements: what a decoder layer keeps (memory.py's terms), with k and v as wide as the
# hidden state (a ViT has no grouped KV heads)
VISION_TERMS_HIDDEN = ACT_HIDDEN_TERMS + RESIDUAL_TERMS + 2


def vision_activation_bytes(tower: VisionTower, patches: int, trained: bool, half_precision: bool) -> int:
    """Activation bytes of the vision tower over ``patches`` patches (one micro-batch's images on one rank): every
    layer's when the tower trains, one layer's (held while it runs, freed after) when it is frozen. Attention
    kernels without a patches x patches matrix (sdpa, flash) assumed."""
    b = 2 if half_precision else 4
    one_layer = b * patches * (VISION_TERMS_HIDDEN * tower.hidden_size + ACT_INTERMEDIATE_TERMS * tower.intermediate_size)
    return one_layer * (tower.depth if trained else 1)


def local_config(model: str | None) -> tuple[dict[str, Any], str] | None:
    """(config.json, its path) of ``model`` when it is a local directory whose config.json reads as a JSON object
    (through ``fsutil.read_json``), else None: a hub id, a built-in tiny model, a file that cannot be read."""
    import os

    from ..fsutil import CONFIG_CAP, Unreadable, read_json

    if not model or not os.path.isdir(model):
        return None
    path = os.path.join(model, "config.json")
    try:
        config = read_json(path, CONFIG_CAP, wide_ints=True)
    except (OSError, Unreadable):
        return None
    return (config, path) if isinstance(config, dict) else None


def read_tower(model: str | None) -> VisionTower:
    """The vision tower of a local model directory's config.json, else ``ASSUMED_TOWER`` (a hub id, a built-in tiny
    model, a config without ``vision_config`` or one that cannot be read: the estimate says it assumed)."""
    found = local_config(model)
    return (tower_from_config(*found) if found else None) or ASSUMED_TOWER


TEXT_ONLY_BUILT_IN = ("tiny-llama", "tiny-moe")  # the built-in models without a vision tower (train/tinymodel.py)


def text_only(model: str | None) -> bool:
    """Whether ``model`` is known to take no images: a built-in text model, or a local directory whose readable
    config.json has no ``vision_config`` (a hub id, or a config that cannot be read, is not known: False)."""
    if model in TEXT_ONLY_BUILT_IN:
        return True
    found = local_config(model)
    return found is not None and "vision_config" not in found[0]


@dataclass(frozen=True)
class ImageFacts:
    """What validate's scan found of a dataset's images (``train/data/images.py`` gathers them)."""

    records: int  # records with at least one image
    images: int  # image references (an image named twice counts twice)
    max_per_record: int
    max_tokens_per_record: int  # the most image tokens one record takes, at the scan's resolution bounds
    largest: tuple[int, int]  # (width, height) of the image of most pixels

    def to_json(self) -> dict[str, Any]:
        return {"records_with_images": self.records, "images": self.images, "max_images_per_record": self.max_per_record,
                "max_image_tokens_per_record": self.max_tokens_per_record, "largest_image": list(self.largest)}


@dataclass(frozen=True)
class ImagePlan:
    """What ``plan`` shows for a dataset with images: the token bound per image and the memory it implies, at the
    resolution bounds (what any image may take) and for this dataset's images (what they take)."""

    facts: ImageFacts
    min_pixels: int
    max_pixels: int
    max_length: int
    micro_batch: int
    tokens_min: int  # the fewest tokens an image takes (a small image is scaled up to image_min_pixels)
    tokens_max: int  # the most (image_max_pixels)
    bound_tokens: int  # image tokens of a micro-batch at image_max_pixels: records x min(images x tokens_max, max_length)
    data_tokens: int  # image tokens of a micro-batch of this dataset at most: records x the most one record took
    vision_bytes: int  # the vision tower's activations over bound_tokens' patches (estimate)
    data_vision_bytes: int  # over data_tokens' patches
    trained: bool  # the vision tower trains (train.freeze_vision = false)
    tower: VisionTower
    rule: TokenRule = QWEN_RULE

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) rows for the plan's text view."""
        f, gib = self.facts, lambda b: f"{b / (1 << 30):.2f} GiB"
        return [
            ("images", f"{f.images:,} in {f.records:,} record(s), up to {f.max_per_record} a record; largest "
                       f"{f.largest[0]} x {f.largest[1]} pixels"),
            ("tokens per image", (f"{self.tokens_max:,} ({self.rule.source})" if self.rule.fixed is not None else
                                  f"{self.tokens_min:,} to {self.tokens_max:,} (train.image_min_pixels = {self.min_pixels:,} "
                                  f"to image_max_pixels = {self.max_pixels:,}, {self.rule.source})")),
            ("image tokens per micro-batch", f"up to {self.bound_tokens:,} at image_max_pixels ({self.micro_batch} record(s) x "
                                             f"{f.max_per_record} image(s) x {self.tokens_max:,}, at most max_length); "
                                             f"{self.data_tokens:,} with this dataset's images. Part of the "
                                             f"{self.micro_batch} x {self.max_length:,} tokens the activations count"),
            ("vision tower activations", f"{gib(self.vision_bytes)} per rank at image_max_pixels, "
                                         f"{gib(self.data_vision_bytes)} with this dataset's images; not in the total above ("
                                         + ("trained: every layer's" if self.trained else "frozen: one layer's at a time")
                                         + f", {self.rule.patches_per_token} patch(es) a token; {self.tower.source})"),
        ]

    def to_json(self) -> dict[str, Any]:
        return {**self.facts.to_json(), "image_min_pixels": self.min_pixels, "image_max_pixels": self.max_pixels,
                "pixels_per_token": None if self.rule.fixed is not None else PIXELS_PER_IMAGE_TOKEN,
                "image_tokens_rule": self.rule.source, "tokens_per_image_min": self.tokens_min,
                "tokens_per_image_max": self.tokens_max, "image_tokens_per_micro_batch": self.bound_tokens,
                "dataset_image_tokens_per_micro_batch": self.data_tokens, "vision_activation_bytes": self.vision_bytes,
                "dataset_vision_activation_bytes": self.data_vision_bytes, "vision_tower_trained": self.trained,
                "vision_tower": self.tower.source}


def image_plan(facts: ImageFacts, *, min_pixels: int, max_pixels: int, max_length: int, micro_batch: int,
               freeze_vision: bool, half_precision: bool, tower: VisionTower = ASSUMED_TOWER,
               rule: TokenRule = QWEN_RULE) -> ImagePlan:
    """The plan's view of a dataset's images under one task's settings (``rule``: the model's ``token_rule``)."""
    tokens_max = rule.most(max_pixels)
    bound = micro_batch * min(facts.max_per_record * tokens_max, max_length)
    data = micro_batch * facts.max_tokens_per_record
    acts = lambda tokens: vision_activation_bytes(tower, tokens * rule.patches_per_token, not freeze_vision,  # noqa: E731
                                                  half_precision)
    return ImagePlan(facts, min_pixels, max_pixels, max_length, micro_batch, tokens_min=rule.fewest(min_pixels, max_pixels),
                     tokens_max=tokens_max, bound_tokens=bound, data_tokens=data, vision_bytes=acts(bound),
                     data_vision_bytes=acts(data), trained=not freeze_vision, tower=tower, rule=rule)
