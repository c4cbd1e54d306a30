"""Cross-field rules of [train] for vision-language models (pure; ``TrainTable._cross`` raises the first).

What needs the dataset (an image taking more tokens than ``max_length`` at ``image_max_pixels``) is checked by
validate's scan, once it has seen an image (``train/data/images.py``): a text job never meets it.
"""

from __future__ import annotations

from typing import Any


def vision_problems(t: Any) -> list[str]:
    out: list[str] = []
    if t.image_min_pixels > t.image_max_pixels:
        out.append(f"image_min_pixels = {t.image_min_pixels:,} is above image_max_pixels = {t.image_max_pixels:,}: an image "
                   "is scaled into [image_min_pixels, image_max_pixels], which holds no size. HINT: lower "
                   "image_min_pixels or raise image_max_pixels")
    return out
