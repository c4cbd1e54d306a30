"""Assets of the vision-language SFT benchmark (issue 56): a model dir with its processor, generated images and records.

    python make_vl_assets.py OUT_DIR [--family qwen|llava] [--tiny] [--images 300] [--samples 400]

- ``--family qwen`` (default): a Qwen2.5-VL-7B-shaped ``Qwen2_5_VLForConditionalGeneration`` with random bf16 weights
  (created on the GPU when there is one: 8.3B parameters in seconds), the config values of Qwen/Qwen2.5-VL-7B-Instruct's
  config.json (``QWEN25_VL_7B`` below); ``--tiny``: a 2-layer model of the same family. Its processor is a
  ``Qwen2_5_VLProcessor`` over ``Qwen2VLImageProcessor`` at swiftslurm's default bounds (``train.image_min_pixels`` =
  32*32, ``image_max_pixels`` = 768*768) and a tokenizer built in code (no download): byte-level (one token per UTF-8
  byte) plus Qwen's special tokens, with a ChatML template that renders an image as
  ``<|vision_start|><|image_pad|><|vision_end|>``. Needs torchvision (Qwen2-VL's image and video processors).
- ``--family llava``: swiftslurm's ``tiny-vl`` (a 2-layer LLaVA, ``swiftslurm/train/tinymodel.py``) saved as a dir, for a
  CPU run of the whole benchmark (no torchvision needed); ``--tiny`` or not, it is the tiny one.

Both templates take a message's content as a string (swiftslurm's records: ``<image>`` replaced by the processor's
placeholder) or as TRL's list of ``{"type": "image"}`` / ``{"type": "text"}`` blocks, and render the same text for both,
so the two arms see the same tokens.

Data: ``--images`` generated pictures (smooth colour fields with shapes; JPEG and PNG; each side 300..1200 px, a third
of them square) and ``--samples`` records in swiftslurm's record format, the messages form with an ``images`` list of
paths relative to the data file and one ``<image>`` per image at the start of the user turn: 85% one image, 10% two, 5%
none. Text lengths are those of packing_e2e.py's alpaca-like records (log-normal, median ~220 tokens, 30% prompt), cut
so that text + image tokens stay under ``--max-length`` (no sample is truncated in either arm).
Prints one JSON line: model_dir, params, data, image and token counts.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                 "<|video_pad|>"]
QWEN_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
# Qwen/Qwen2.5-VL-7B-Instruct config.json (text and vision), the token ids excepted (the tokenizer here is built in code)
QWEN25_VL_7B = dict(
    text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
              vocab_size=152064, max_position_embeddings=128000, rms_norm_eps=1e-6, hidden_act="silu", sliding_window=32768,
              use_sliding_window=False, max_window_layers=28, attention_dropout=0.0, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}),
    vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, patch_size=14,
                spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                tokens_per_second=2, hidden_act="silu", in_channels=3),
)
QWEN_TINY = dict(  # the same family, 2 layers each side: head_dim 32, so mrope_section sums to 16
    text=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=512, max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]}),
    vision=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128, patch_size=14,
                spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1], tokens_per_second=2,
                hidden_act="silu", in_channels=3),
)


def _content(kind: str) -> str:
    """A chat-template fragment: a message's content, a string or TRL's list of image / text blocks."""
    image = QWEN_PLACEHOLDER if kind == "qwen" else "<image>"
    return ("{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
            f"{{% if c['type'] == 'image' %}}{image}{{% elif c['type'] == 'text' %}}{{{{ c['text'] }}}}{{% endif %}}"
            "{% endfor %}{% endif %}")


# Qwen2.5-VL's ChatML (its default system turn included)
QWEN_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' }}" + _content("qwen") + "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# tiny-vl's template (tinymodel.CHAT_TEMPLATE) with list content too
LLAVA_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' }}" + _content("llava") +
    "{% if m['role'] == 'assistant' %}{{ '</s>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def qwen_model(model_dir: Path, tiny: bool, min_pixels: int, max_pixels: int) -> int:
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor, Qwen2VLImageProcessor

    from swiftslurm.train.tinymodel import build_tokenizer

    tok = build_tokenizer()  # byte-level, <pad> <s> </s>; then Qwen's special tokens
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS})
    tok.pad_token, tok.eos_token = "<|endoftext|>", "<|im_end|>"
    tok.chat_template = QWEN_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    shape = QWEN_TINY if tiny else QWEN25_VL_7B
    text = dict(shape["text"], bos_token_id=tok.bos_token_id, eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=shape["vision"], image_token_id=ids["<|image_pad|>"],
                              video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    images = Qwen2VLImageProcessor(size={"shortest_edge": min_pixels, "longest_edge": max_pixels})
    try:  # the processor wants its video processor too (torchvision as well)
        from transformers import Qwen2VLVideoProcessor

        video = Qwen2VLVideoProcessor()
    except Exception:  # noqa: BLE001 -- no torchvision: transformers raises ImportError or fails in the class lookup
        video = None
    processor = Qwen2_5_VLProcessor(image_processor=images, tokenizer=tok, video_processor=video, chat_template=QWEN_TEMPLATE)
    torch.manual_seed(0)
    if torch.cuda.is_available():  # 8.3B random bf16 weights: initialised on the GPU, in seconds
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            model = Qwen2_5_VLForConditionalGeneration(config)
        torch.set_default_dtype(torch.float32)
    else:
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(model_dir)
    processor.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    return sum(p.numel() for p in model.parameters())


def llava_model(model_dir: Path, max_length: int) -> int:
    import torch

    from swiftslurm.train.tinymodel import TINY_VL, build_model, build_processing

    processor = build_processing(TINY_VL)
    processor.chat_template = processor.tokenizer.chat_template = LLAVA_TEMPLATE
    model = build_model(len(processor.tokenizer), max_length, seed=0, name=TINY_VL).to(torch.bfloat16)
    model.save_pretrained(model_dir)
    processor.save_pretrained(model_dir)
    return sum(p.numel() for p in model.parameters())


def make_images(folder: Path, n: int, rng: random.Random) -> list[tuple[str, int, int]]:
    """``n`` pictures: a smooth colour field (a small random grid scaled up) with a few shapes, JPEG or PNG."""
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        w = rng.randint(300, 1200)
        h = w if i % 3 == 0 else rng.randint(300, 1200)
        small = Image.new("RGB", (4, 4))
        small.putdata([tuple(rng.randrange(256) for _ in range(3)) for _ in range(16)])
        image = small.resize((w, h), Image.BILINEAR)
        draw = ImageDraw.Draw(image)
        for _ in range(rng.randint(2, 6)):
            x, y = rng.randrange(w), rng.randrange(h)
            r = rng.randint(20, max(21, min(w, h) // 4))
            fill = tuple(rng.randrange(256) for _ in range(3))
            (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x - r, y - r, x + r, y + r), fill=fill)
        name = f"img_{i:04d}.{'png' if i % 4 == 0 else 'jpg'}"
        image.save(folder / name, quality=90) if name.endswith("jpg") else image.save(folder / name)
        out.append((f"{folder.name}/{name}", w, h))
    return out


def image_tokens(family: str, w: int, h: int, min_pixels: int, max_pixels: int) -> int:
    if family == "llava":
        from swiftslurm.train.tinymodel import IMAGE_SIDE, PATCH

        return (IMAGE_SIDE // PATCH) ** 2  # tiny-vl: 2x2 patches of a 28x28 crop
    from swiftslurm.sizing.vision import image_tokens as qwen_tokens

    return qwen_tokens(w, h, min_pixels, max_pixels)


def make_records(path: Path, images: list[tuple[str, int, int]], n: int, rng: random.Random, family: str, max_length: int,
                 min_pixels: int, max_pixels: int) -> dict:
    letters = "abcdefghijklmnopqrstuvwxyz     "
    counts = {"records": n, "images": 0, "image_tokens": 0, "text_chars": 0}
    with open(path, "w") as fh:
        for _ in range(n):
            roll = rng.random()
            chosen = [] if roll < 0.05 else rng.sample(images, 2 if roll < 0.15 else 1)
            tokens = sum(image_tokens(family, w, h, min_pixels, max_pixels) for _, w, h in chosen)
            # packing_e2e.alpaca_like's lengths, less the room the images and the template take
            length = max(16, min(max_length - tokens - 120, int(rng.lognormvariate(5.4, 0.6)) - 30))
            prompt = max(4, int(length * 0.3))
            user = "<image>" * len(chosen) + "\n" * bool(chosen) + "".join(rng.choice(letters) for _ in range(prompt))
            answer = "".join(rng.choice(letters) for _ in range(length - prompt))
            fh.write(json.dumps({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
                                 "images": [p for p, _, _ in chosen]}) + "\n")
            counts["images"] += len(chosen)
            counts["image_tokens"] += tokens
            counts["text_chars"] += length
    return counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--family", choices=["qwen", "llava"], default="qwen")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--images", type=int, default=300)
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--min-pixels", type=int, default=32 * 32, help="train.image_min_pixels (swiftslurm's default)")
    ap.add_argument("--max-pixels", type=int, default=768 * 768, help="train.image_max_pixels (swiftslurm's default)")
    a = ap.parse_args()
    out = Path(a.out)
    name = "tiny-vl" if a.family == "llava" else "qwen25vl_tiny" if a.tiny else "qwen25vl7b"
    model_dir = out / name
    if a.family == "llava":
        params = llava_model(model_dir, a.max_length)
    else:
        params = qwen_model(model_dir, a.tiny, a.min_pixels, a.max_pixels)
    rng = random.Random(0)
    data_dir = out / "vl_data"
    images = make_images(data_dir / "images", a.images, rng)
    data = data_dir / "records.jsonl"
    counts = make_records(data, images, a.samples, rng, a.family, a.max_length, a.min_pixels, a.max_pixels)
    print(json.dumps({"model_dir": str(model_dir), "family": a.family, "params": params, "data": str(data), **counts}))


if __name__ == "__main__":
    main()
