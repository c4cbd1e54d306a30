"""Cross-field rules of [train] for vision-language models (pure; ``TrainTable._cross`` raises the first).

What needs the dataset (an image taking more tokens than ``max_length`` at ``image_max_pixels``) is checked by
validate's scan, once it has seen an image (``train/data/images.py``): a text job never meets it.
"""

from __future__ import annotations

from typing import Any

from ..tasks import TASKS

TINY_VL = "tiny-vl"  # the built-in vision-language model (train/tinymodel.py): known to take images without a config


def vision_problems(t: Any) -> list[str]:
    out: list[str] = []
    if t.image_min_pixels > t.image_max_pixels:
        out.append(f"image_min_pixels = {t.image_min_pixels:,} is above image_max_pixels = {t.image_max_pixels:,}: an image "
                   "is scaled into [image_min_pixels, image_max_pixels], which holds no size. HINT: lower "
                   "image_min_pixels or raise image_max_pixels")
    if t.train_type == "lora" and not (t.freeze_vision and t.freeze_projector):
        which = " and ".join(k for k in ("freeze_vision", "freeze_projector") if not getattr(t, k))
        out.append(f"{which} = false with train_type = \"lora\": LoRA trains adapters on the language model and keeps every "
                   "base weight frozen, the vision tower and projector included, so the switch would change nothing. "
                   "HINT: train_type = \"full\" to train them, or drop the key")
    if t.model == TINY_VL and not TASKS[t.task].images:
        able = ", ".join(repr(n) for n, row in TASKS.items() if row.images)
        out.append(f"model = \"{TINY_VL}\" with task = {t.task!r}: a vision-language model trains with task = {able} only; "
                   f"the nodes would refuse it. HINT: task = {able}, or a text model for {t.task!r}")
    return out
