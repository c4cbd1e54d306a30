"""Vision-language records at validate: a record with images passes only when every image is a readable image file
its text points at, and a bad one is one message naming file and line (exit 2). Images are made here, with Pillow."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

from swiftslurm.cli import app
from swiftslurm.sizing.vision import PIXELS_PER_IMAGE_TOKEN, image_tokens, max_image_tokens
from swiftslurm.train.data.images import (
    BadImage,
    DataError,
    check_image,
    image_paths,
    load_image,
    placeholder_count,
)

ROOT = Path(__file__).resolve().parents[1]


def record(images: list[str], text: str | None = None) -> dict:
    """A user turn with one <image> per image (or ``text``) and an answer."""
    user = text if text is not None else "<image>" * len(images) + "What is shown?"
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "A square."}],
            **({"images": images} if images else {})}


def dataset(root: Path, *records: dict) -> Path:
    """``root/data/d.jsonl`` holding ``records`` (one a line), with a good PNG at ``root/data/img/ok.png``."""
    (root / "data" / "img").mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (64, 48), (200, 30, 30)).save(root / "data" / "img" / "ok.png")
    path = root / "data" / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def spec(root: Path, data: Path, model: str = "tiny-vl", **train: object) -> Path:
    """A CPU spec of the tiny vision-language model (or ``model``) on ``data`` (absolute), with ``train`` keys added."""
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in train.items())
    path = root / "job.toml"
    path.write_text(f'[job]\noutput_dir = "{root / "out"}"\n[slurm]\nnodes = 1\ntasks_per_node = 1\n'
                    f'[train]\nmodel = {json.dumps(model)}\ndataset = ["{data}"]\n{extra}[preflight]\nchecks = []\n')
    return path


def model_dir(root: Path, kind: str) -> str:
    """A local model directory holding only a config.json (what validate and plan read): Qwen2-VL-2B's shape, or
    LLaVA-1.5-7B's (a CLIP tower on 336 x 336 images in 14 x 14 patches)."""
    configs = {
        "qwen2_vl": {"model_type": "qwen2_vl", "vision_config": {"embed_dim": 1280, "depth": 32}, "hidden_size": 1536,
                     "num_hidden_layers": 28, "vocab_size": 151936, "intermediate_size": 8960, "num_attention_heads": 12,
                     "num_key_value_heads": 2},
        "llava": {"model_type": "llava", "vision_feature_select_strategy": "default",
                  "vision_config": {"image_size": 336, "patch_size": 14, "hidden_size": 1024, "num_hidden_layers": 24,
                                    "intermediate_size": 4096},
                  "text_config": {"hidden_size": 4096, "num_hidden_layers": 32, "vocab_size": 32064,
                                  "num_attention_heads": 32, "intermediate_size": 11008}},
    }
    d = root / kind
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(configs[kind]))
    return str(d)


def swiftslurm(*args: str, cwd: Path) -> tuple[int, str]:
    """The real CLI in this process (exit code, stdout + stderr), run from ``cwd``."""
    old = os.getcwd()
    os.chdir(cwd)
    try:
        result = CliRunner().invoke(app, list(args))
    finally:
        os.chdir(old)
    assert result.exception is None or isinstance(result.exception, SystemExit), (result.exception, result.output)
    return result.exit_code, result.output


def refused(root: Path, data: Path, **train: object) -> str:
    """validate's one message for a bad dataset (exit 2, no traceback, nothing written)."""
    before = sorted(p for p in root.rglob("*"))
    code, out = swiftslurm("validate", str(spec(root, data, **train)), cwd=root)
    assert code == 2, out
    assert out.count("error:") == 1 and "Traceback" not in out, out
    assert sorted(p for p in root.rglob("*")) == sorted({*before, root / "job.toml"}), "validate wrote something"
    return out


def truncated_png(path: Path) -> None:
    Image.effect_noise((64, 64), 60).convert("RGB").save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def huge_png_header(path: Path, side: int) -> None:
    """A PNG whose header says side x side pixels, with a tiny IDAT: a decompression bomb's shape."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))


# ------------------------------------------------------------------ good records


def test_a_good_dataset_passes_and_relative_paths_start_at_the_data_files_directory(tmp_path):
    data = dataset(tmp_path, record(["img/ok.png"]), record([]),
                   record([str(tmp_path / "data" / "img" / "ok.png"), "img/b.jpg"]))  # an absolute path, then a JPEG
    Image.new("RGB", (90, 30), (0, 0, 255)).save(tmp_path / "data" / "img" / "b.jpg")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "img").mkdir(parents=True)  # the cwd has no img/ok.png: only the data file's directory does
    code, out = swiftslurm("validate", str(spec(tmp_path, data)), cwd=elsewhere)
    assert code == 0, out
    assert "3 record(s)" in out and "images: 3 in 2 record(s) checked, up to 2 a record" in out, out

    only_in_cwd = dataset(tmp_path / "other", record(["img/cwd.png"]))  # an image beside the cwd, not the data file
    Image.new("RGB", (32, 32)).save(elsewhere / "img" / "cwd.png")
    code, out = swiftslurm("validate", str(spec(tmp_path / "other", only_in_cwd)), cwd=elsewhere)
    assert code == 2 and f"{only_in_cwd}, line 1: image 1 ('img/cwd.png') does not exist" in out, out


def test_image_paths_and_placeholders_are_the_contract_the_trainer_reads(tmp_path):
    rec = record(["a.png", "/abs/b.png"])
    assert placeholder_count(rec) == 2 and placeholder_count(record([])) == 0
    assert image_paths(rec, tmp_path / "d" / "x.jsonl", "line 3") == [tmp_path / "d" / "a.png", Path("/abs/b.png")]
    assert image_paths(record([]), tmp_path / "x.jsonl") == []
    with pytest.raises(DataError, match=r"x.jsonl, line 3: 1 <image> placeholder\(s\) in the messages for 2 image"):
        image_paths(record(["a.png", "b.png"], text="<image> one"), tmp_path / "x.jsonl", "line 3")
    Image.new("RGBA", (40, 20)).save(tmp_path / "c.png")
    assert check_image(tmp_path / "c.png").format == "PNG"
    assert load_image(tmp_path / "c.png").mode == "RGB" and load_image(tmp_path / "c.png").size == (40, 20)
    (tmp_path / "t.png").write_text("no image")
    with pytest.raises(BadImage, match="is not a PNG"):
        load_image(tmp_path / "t.png")


def test_a_phone_photo_stored_turned_is_read_and_counted_upright(tmp_path):
    """A JPEG stored 80 x 40 (red above, blue below) whose EXIF orientation (6) says to show it turned a quarter
    clockwise, as a phone writes a portrait photo: its size is 40 x 80 for validate's count and the trainer's bounds,
    and the trainer sees it upright, red on the right (transformers' own load_image turns it the same way)."""
    from swiftslurm.train.data.images import image_size

    stored = Image.new("RGB", (80, 40), (0, 0, 255))
    stored.paste((255, 0, 0), (0, 0, 80, 20))
    exif = stored.getexif()
    exif[0x0112] = 6
    path = tmp_path / "portrait.jpg"
    stored.save(path, "JPEG", exif=exif.tobytes(), quality=95)
    assert image_size(path) == (40, 80) and (check_image(path).width, check_image(path).height) == (40, 80)
    shown = load_image(path)
    assert shown.size == (40, 80)
    red, blue = shown.getpixel((35, 40)), shown.getpixel((5, 40))
    assert red[0] > 200 > red[2] and blue[2] > 200 > blue[0], (red, blue)


def test_a_16_bit_grayscale_png_keeps_its_greys_and_transparency_is_white_as_transformers_makes_it(tmp_path):
    """Pillow's own RGB conversion clips a 16-bit grayscale image at 255 (mid-grey 32768 comes out white); the trainer
    scales it to 8 bits. A transparent pixel comes out white, as transformers' convert_to_rgb composites it (a plain
    conversion would show the colour stored under it)."""
    import numpy as np
    from transformers.image_transforms import convert_to_rgb

    Image.fromarray(np.array([[0, 32768], [65535, 16384]], dtype=np.uint16)).save(tmp_path / "depth.png")
    assert Image.open(tmp_path / "depth.png").mode == "I;16"
    grey = load_image(tmp_path / "depth.png")
    assert [grey.getpixel(xy) for xy in ((0, 0), (1, 0), (0, 1), (1, 1))] == [(0, 0, 0), (127, 127, 127), (255, 255, 255), (63, 63, 63)]
    clear = Image.new("RGBA", (2, 1), (255, 0, 0, 255))
    clear.putpixel((1, 0), (0, 0, 255, 0))  # blue, fully transparent
    clear.save(tmp_path / "clear.png")
    shown = load_image(tmp_path / "clear.png")
    assert [shown.getpixel((0, 0)), shown.getpixel((1, 0))] == [(255, 0, 0), (255, 255, 255)]
    theirs = convert_to_rgb(Image.open(tmp_path / "clear.png"), return_numpy=True).reshape(-1, 3).tolist()
    assert list(shown.getdata()) == [tuple(px) for px in theirs]


def test_tokens_an_image_takes_follow_qwen2_vl_resizing():
    assert PIXELS_PER_IMAGE_TOKEN == 28 * 28
    assert image_tokens(84, 56, 1, 3136) == 2  # transformers' Qwen2-VL processor at max_pixels 3136 (notes, round 4)
    assert max_image_tokens(768 * 768) == 752 and image_tokens(768, 768, 32 * 32, 768 * 768) == 27 * 27  # sides 756
    assert image_tokens(4000, 3000, 32 * 32, 768 * 768) <= 752  # scaled down into the bound
    assert image_tokens(10, 10, 56 * 56, 768 * 768) == 4  # scaled up to image_min_pixels


def test_a_llava_config_says_its_fixed_count_and_any_other_keeps_qwen2_vls_bound():
    from swiftslurm.sizing.vision import QWEN_RULE, llava_rule, token_rule

    clip = {"image_size": 336, "patch_size": 14}
    assert llava_rule({"model_type": "llava", "vision_config": clip}, "c").fixed == 576  # the CLS feature dropped
    assert llava_rule({"model_type": "llava", "vision_config": clip, "vision_feature_select_strategy": "full"}, "c").fixed == 577
    assert llava_rule({"model_type": "qwen2_vl", "vision_config": clip}, "c") is None
    assert llava_rule({"model_type": "llava", "vision_config": {"image_size": "336"}}, "c") is None  # unreadable: no claim
    assert token_rule("Qwen/Qwen2-VL-2B-Instruct") == QWEN_RULE == token_rule("/no/such/dir")
    assert token_rule("tiny-vl").tokens(4000, 3000, 784, 3136) == 4


# ------------------------------------------------------------------ each bad record: one message, file and line


def _missing(d: Path) -> dict:
    return record(["img/gone.png"])


def _not_an_image(d: Path) -> dict:
    (d / "img" / "notes.png").write_text("these are notes, not pixels\n")
    return record(["img/notes.png"])


def _too_big(d: Path) -> dict:  # sparse: refused by its size, never read
    with (d / "img" / "big.png").open("wb") as f:
        f.truncate(64 * 1024 * 1024 + 1)
    return record(["img/big.png"])


def _truncated_png(d: Path) -> dict:
    truncated_png(d / "img" / "cut.png")
    return record(["img/cut.png"])


def _truncated_jpeg(d: Path) -> dict:
    Image.effect_noise((128, 128), 60).convert("RGB").save(d / "img" / "cut.jpg", quality=95)
    data = (d / "img" / "cut.jpg").read_bytes()
    (d / "img" / "cut.jpg").write_bytes(data[: len(data) // 2])
    return record(["img/cut.jpg"])


def _bomb(d: Path) -> dict:  # over our cap, under Pillow's
    huge_png_header(d / "img" / "bomb.png", 9000)
    return record(["img/bomb.png"])


def _pillows_bomb(d: Path) -> dict:  # over twice Pillow's limit: Pillow refuses it first
    huge_png_header(d / "img" / "bomb.png", 100_000)
    return record(["img/bomb.png"])


def _count_mismatch(d: Path) -> dict:
    return record(["img/ok.png", "img/ok.png"], text="<image> only one placeholder")


def _absolute_missing(d: Path) -> dict:
    return record([str(d / "nowhere" / "abs.png")])


def _url(d: Path) -> dict:
    return record(["https://example.com/a.png"])


def _alpaca_with_images(d: Path) -> dict:
    return {"instruction": "<image> describe", "output": "a square", "images": ["img/ok.png"]}


def parts(*content: dict) -> dict:
    """A record in TRL's and the hub datasets' form: the user's content a list of parts, the answer one text part."""
    return {"messages": [{"role": "user", "content": list(content)},
                         {"role": "assistant", "content": [{"type": "text", "text": "A square."}]}], "images": ["img/ok.png"]}


def _inline_image_part(d: Path) -> dict:
    return parts({"type": "image", "image": "img/ok.png"}, {"type": "text", "text": "What is shown?"})


def _image_url_part(d: Path) -> dict:
    return parts({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, {"type": "text", "text": "What?"})


def _image_part_out_of_order(d: Path) -> dict:
    return parts({"type": "image", "index": 1, "text": None}, {"type": "text", "text": "What is shown?"})


BAD_RECORDS = [  # (what makes the second record of the dataset, the words of its one message)
    (_missing, "image 1 ('img/gone.png') does not exist"),
    (_not_an_image, "image 1 ('img/notes.png') is not a PNG, JPEG, WEBP, GIF or BMP image"),
    (_too_big, "image 1 ('img/big.png') is 67108865 bytes, over the 64 MiB cap"),
    (_truncated_png, "image 1 ('img/cut.png') cannot be decoded"),
    (_truncated_jpeg, "image 1 ('img/cut.jpg') cannot be decoded"),
    (_bomb, "image 1 ('img/bomb.png') is 9000 x 9000 = 81,000,000 pixels, over 67,108,864, the cap on an image"),
    (_pillows_bomb, "image 1 ('img/bomb.png') is over 67,108,864 pixels, the cap on an image to decode"),
    (_count_mismatch, "1 <image> placeholder(s) in the messages for 2 image(s)"),
    (_absolute_missing, "does not exist"),
    (_url, "image 1 is a URL, not a local file"),
    (_alpaca_with_images, "a record with images must be in the messages form"),
    (_inline_image_part, "an image part holding its image (image) is not taken"),
    (_image_url_part, "a content part of type 'image_url' is not taken"),
    (_image_part_out_of_order, "image part 1 says index 1"),
]


@pytest.mark.parametrize("make,words", BAD_RECORDS, ids=[make.__name__.strip("_") for make, _ in BAD_RECORDS])
def test_a_bad_image_record_is_one_message_naming_file_and_line(tmp_path, make, words):
    data = dataset(tmp_path, record(["img/ok.png"]))
    with data.open("a") as f:
        f.write(json.dumps(make(tmp_path / "data")) + "\n")
    out = refused(tmp_path, data)
    assert f"{data}, line 2: " in out and words in out, out
    if make is _absolute_missing:
        assert str(tmp_path / "data" / "nowhere" / "abs.png") in out, out


def test_content_parts_are_read_as_the_placeholder_form_and_train_the_same_tokens(tmp_path):
    """TRL's vision form (a columnar file gives every part every key, nulls included, and an image part its index)
    validates, and its sample is the <image> form's, token for token and pixel for pixel."""
    from swiftslurm.train.data.vision import VisionDataset, read_conversations
    from swiftslurm.train.tinymodel import build_processing

    text = dataset(tmp_path, record(["img/ok.png"]))
    form = tmp_path / "data" / "parts.jsonl"
    form.write_text(json.dumps(parts({"type": "image", "index": 0, "text": None},
                                     {"type": "text", "index": None, "text": "What is shown?"})) + "\n")
    code, out = swiftslurm("validate", str(spec(tmp_path, form)), cwd=tmp_path)
    assert code == 0 and "images: 1 in 1 record(s) checked" in out, out
    processor = build_processing("tiny-vl")
    one, other = (VisionDataset(read_conversations([str(p)]), processor, 128, 784, 3136)[0] for p in (text, form))
    assert one["input_ids"] == other["input_ids"] and one["labels"] == other["labels"]
    assert one["pixel_values"].equal(other["pixel_values"])


def test_an_image_over_max_length_is_refused_at_the_bound_and_per_record(tmp_path):
    data = dataset(tmp_path, record(["img/ok.png"]))
    qwen = model_dir(tmp_path / "models", "qwen2_vl")
    out = refused(tmp_path, data, model=qwen, max_length=512)  # 768 x 768 pixels: 752 tokens
    assert "train.image_max_pixels = 589,824 lets one image take up to 752 tokens" in out, out
    assert "train.max_length = 512" in out and "lower train.image_max_pixels to at most 401,408" in out, out
    # LLaVA resizes every image to its one square: its count, whatever image_max_pixels says
    out = refused(tmp_path, data, model=model_dir(tmp_path / "models", "llava"), max_length=512)
    assert "every image takes 576 tokens" in out and "LLaVA, every image 336 x 336 pixels in 14 x 14 patches" in out, out
    assert "raise train.max_length to at least 577" in out, out
    code, out = swiftslurm("validate", str(spec(tmp_path, data, max_length=512)), cwd=tmp_path)  # tiny-vl: 4 tokens
    assert code == 0 and "each takes 4 tokens (every image 28 x 28 pixels" in out, out

    for name in ("a", "b", "c"):
        Image.new("RGB", (100, 100)).save(tmp_path / "data" / "img" / f"{name}.png")  # 4 tokens each at 6,272 pixels
    data.write_text(json.dumps(record(["img/a.png"])) + "\n" + json.dumps(record(["img/a.png", "img/b.png", "img/c.png"])) + "\n")
    out = refused(tmp_path, data, max_length=8, image_max_pixels=8 * PIXELS_PER_IMAGE_TOKEN, packing=False)
    assert f"{data}, line 2: its 3 image(s) take 12 tokens, more than train.max_length = 8" in out, out


def test_min_pixels_above_max_pixels_is_a_spec_problem(tmp_path):
    data = dataset(tmp_path, record(["img/ok.png"]))
    out = refused(tmp_path, data, image_min_pixels=1000, image_max_pixels=999)
    assert "image_min_pixels = 1,000 is above image_max_pixels = 999" in out, out


def test_a_stray_placeholder_counts_only_once_the_dataset_has_images(tmp_path):
    text_only = dataset(tmp_path, record([], text="what does <image> mean in HTML?"))
    code, out = swiftslurm("validate", str(spec(tmp_path, text_only)), cwd=tmp_path)
    assert code == 0 and "images:" not in out, out  # a text dataset: <image> is text
    with text_only.open("a") as f:
        f.write(json.dumps(record(["img/ok.png"])) + "\n")
    out = refused(tmp_path, text_only)
    assert f"{text_only}, line 1: 1 <image> placeholder(s) in a record without images" in out, out


def test_a_fifo_in_an_images_place_is_refused_without_blocking(tmp_path):
    data = dataset(tmp_path, record(["img/pipe.png"]))
    os.mkfifo(tmp_path / "data" / "img" / "pipe.png")  # nobody writes: an open that blocks never returns
    r = subprocess.run([sys.executable, "-m", "swiftslurm", "validate", str(spec(tmp_path, data))], capture_output=True,
                       text=True, cwd=tmp_path, timeout=60, env={**os.environ, "SWIFTSLURM_DEBUG": "0"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{data}, line 1: image 1 ('img/pipe.png') is a FIFO, not a regular file" in r.stderr, r.stderr


def test_validate_plan_and_submit_refuse_the_same_record(tmp_path):
    data = dataset(tmp_path, record(["img/ok.png", "img/ok.png"], text="<image>"))
    job = spec(tmp_path, data)
    outs = {cmd: swiftslurm(*cmd.split(), str(job), cwd=tmp_path) for cmd in ("validate", "plan", "submit --executor local")}
    assert {code for code, _ in outs.values()} == {2}, outs
    assert len({out for _, out in outs.values()}) == 1 and f"{data}, line 1: " in outs["validate"][1], outs
    assert not (tmp_path / "out").exists()


def test_without_pillow_a_dataset_with_images_is_refused_with_the_extra_to_install(tmp_path):
    data = dataset(tmp_path, record(["img/ok.png"]))
    code = ("import sys; sys.modules['PIL'] = None; sys.argv = ['swiftslurm', 'validate', sys.argv[1]]; "
            "from swiftslurm.cli.app import main; main()")
    r = subprocess.run([sys.executable, "-c", code, str(spec(tmp_path, data))], capture_output=True, text=True,
                       cwd=tmp_path, timeout=60, env={**os.environ, "SWIFTSLURM_DEBUG": "0"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "need Pillow" in r.stderr and "swiftslurm[train]" in r.stderr, r.stderr


# ------------------------------------------------------------------ plan: the token bound and its memory


def test_plan_shows_the_image_token_bound_and_memory_only_for_a_dataset_with_images(tmp_path):
    data = dataset(tmp_path, record(["img/ok.png", "img/ok.png"]), record([]))
    job = spec(tmp_path, data, model=model_dir(tmp_path / "models", "qwen2_vl"), per_device_train_batch_size=2)
    code, out = swiftslurm("plan", "--json", str(job), cwd=tmp_path)
    assert code == 0, out
    images = json.loads(out)["images"]["0"]
    assert images["tokens_per_image_max"] == 752 and images["max_images_per_record"] == 2, images
    assert images["image_tokens_per_micro_batch"] == 2 * 2 * 752  # 2 records x 2 images x 752, under max_length 2048
    assert images["vision_activation_bytes"] > images["dataset_vision_activation_bytes"] > 0, images
    code, text = swiftslurm("plan", str(job), cwd=tmp_path)
    assert code == 0 and "tokens per image" in text and "vision tower activations" in text, text
    # tiny-vl (LLaVA): 4 tokens an image, whatever its size, so the bound is what this dataset takes
    code, out = swiftslurm("plan", "--json", str(spec(tmp_path, data, per_device_train_batch_size=2)), cwd=tmp_path)
    images = json.loads(out)["images"]["0"]
    assert images["tokens_per_image_min"] == images["tokens_per_image_max"] == 4 and images["pixels_per_token"] is None
    assert images["image_tokens_per_micro_batch"] == images["dataset_image_tokens_per_micro_batch"] == 2 * 2 * 4, images

    text_data = dataset(tmp_path / "text", record([]))
    code, out = swiftslurm("plan", "--json", str(spec(tmp_path / "text", text_data)), cwd=tmp_path)
    assert code == 0 and "images" not in json.loads(out), out
    code, text = swiftslurm("plan", str(spec(tmp_path / "text", text_data)), cwd=tmp_path)
    assert code == 0 and "tokens per image" not in text, text


def test_what_the_nodes_would_refuse_of_a_vision_language_spec_is_refused_at_validate(tmp_path):
    data = dataset(tmp_path, record(["img/ok.png"]))
    out = refused(tmp_path, data, train_type="lora", freeze_vision=False)  # LoRA freezes every base weight anyway
    assert "freeze_vision = false with train_type = \"lora\"" in out and "HINT" in out, out
    path = spec(tmp_path, data, task="rm")
    code, out = swiftslurm("validate", str(path), cwd=tmp_path)
    assert code == 2 and out.count("error:") == 1 and "model = \"tiny-vl\" with task = 'rm'" in out, out
    path = spec(tmp_path, data, deepspeed="zero3")  # trains (tests/test_one_process_runs.py): validate takes it
    code, out = swiftslurm("validate", str(path), cwd=tmp_path)
    assert code == 0, out


# ---------------------------------------------------------------- preference pairs with images (task = "dpo")


def pair(images: list[str], prompt: str | None = None, chosen: str = "A red square.") -> dict:
    """A conversational preference pair whose prompt holds one <image> per image (or ``prompt``)."""
    user = prompt if prompt is not None else "<image>" * len(images) + "What is shown?"
    return {"prompt": [{"role": "user", "content": user}], "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": "A blue circle."}], **({"images": images} if images else {})}


def test_preference_pairs_with_images_are_checked_at_validate_as_sft_records_are(tmp_path):
    def vl_dpo(data: Path, **train: object) -> Path:
        return spec(tmp_path, data, task="dpo", **train)

    data = dataset(tmp_path, pair(["img/ok.png"]), pair(["img/ok.png", "img/ok.png"], "<image> or <image>?"), pair([]))
    code, out = swiftslurm("validate", str(vl_dpo(data)), cwd=tmp_path)
    assert code == 0 and "images: 3 in 2 record(s) checked, up to 2 a record" in " ".join(out.split()), out

    def refused_pair(*records: dict, **train: object) -> str:
        code, out = swiftslurm("validate", str(vl_dpo(dataset(tmp_path, *records), **train)), cwd=tmp_path)
        assert code == 2 and out.count("error:") == 1 and "Traceback" not in out, out
        return " ".join(out.split())

    assert "line 2: image 1" in refused_pair(pair(["img/ok.png"]), pair(["img/missing.png"]))
    assert "line 1: 1 <image> placeholder(s) in the messages for 2 image(s)" in refused_pair(pair(["img/ok.png", "img/ok.png"], "<image>?"))
    assert "an <image> in 'chosen'" in refused_pair(pair(["img/ok.png"], chosen="<image> is red."))
    assert "precompute_ref_log_probs with preference pairs that hold images" in refused_pair(pair(["img/ok.png"]),
                                                                                          precompute_ref_log_probs=True)
    # the string form holds no place for an image; a reward model trains on text only
    flat = {"prompt": "<image>What is shown?", "chosen": "red", "rejected": "blue", "images": ["img/ok.png"]}
    assert "line 1: a record with images must be in the messages form" in refused_pair(flat)
    path = spec(tmp_path, dataset(tmp_path, pair(["img/ok.png"])), task="rm")
    path.write_text(path.read_text().replace('model = "tiny-vl"', 'model = "tiny-llama"'))
    code, out = swiftslurm("validate", str(path), cwd=tmp_path)
    assert code == 2 and "line 1: a record with images, and train." in " ".join(out.split()), out


def test_records_with_images_for_a_text_model_are_refused_never_trained_without_their_images(tmp_path):
    from swiftslurm.train.data.tokens import load_dataset
    from swiftslurm.train.tinymodel import build_tokenizer

    data = dataset(tmp_path, record([], "What is a square?"), record(["img/ok.png"]))
    model_dir = tmp_path / "text-model"  # a local model whose config.json has no vision_config
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                                    "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 260}))
    for model in ("tiny-llama", str(model_dir)):
        path = spec(tmp_path, data)
        path.write_text(path.read_text().replace('model = "tiny-vl"', f'model = "{model}"'))
        code, out = swiftslurm("validate", str(path), cwd=tmp_path)
        flat = " ".join(out.split())
        assert code == 2 and f"line 2: a record with images, and train.model = '{model}' takes text only" in flat, out
    # a hub id validate cannot read: the node's text path refuses the record as it tokenizes it
    with pytest.raises(DataError, match="line 2: a record with images, and train.model takes text only"):
        load_dataset([str(data)], build_tokenizer(), 128)


@pytest.mark.parametrize("task,rec", [
    ("pt", {"text": "<image> a red square", "images": ["img/ok.png"]}),
    ("kto", {"prompt": "<image>What is shown?", "completion": "red", "label": True, "images": ["img/ok.png"]}),
    ("grpo", {"prompt": "<image>What is shown?", "images": ["img/ok.png"]}),
])
def test_a_text_only_tasks_record_with_images_is_refused_at_validate(tmp_path, task, rec):
    extra = {"reward_funcs": ["length"], "reward_length_target": 16, "num_generations": 2, "per_device_train_batch_size": 2,
             "max_completion_length": 16} if task == "grpo" else {"per_device_train_batch_size": 2} if task == "kto" else {}
    path = spec(tmp_path, dataset(tmp_path, rec), task=task, **extra)
    path.write_text(path.read_text().replace('model = "tiny-vl"', 'model = "tiny-llama"'))
    code, out = swiftslurm("validate", str(path), cwd=tmp_path)
    flat = " ".join(out.split())
    assert code == 2 and out.count("error:") == 1, out
    assert f"d.jsonl, line 1: a record with images, and train.task = '{task}' trains on text only" in flat, out


def test_records_with_images_that_reach_a_text_model_or_task_on_the_node_are_refused():
    """A hub model validate could not read: TRL's tasks refuse the records as they load them (trl_task)."""
    from swiftslurm.spec import parse_spec
    from swiftslurm.train.data.records import DataError as NodeDataError
    from swiftslurm.train.tasks.trl_task import refuse_images_here
    from swiftslurm.train.tinymodel import build_processing

    job = parse_spec('[job]\nname = "x"\n[train]\nmodel = "org/some-model"\ndataset = ["pairs.jsonl"]\ntask = "dpo"\n')
    with pytest.raises(NodeDataError, match="train.model = 'org/some-model' takes text only"):
        refuse_images_here(job, build_processing("tiny-llama"), "dpo")
    with pytest.raises(NodeDataError, match="train.task = 'rm' trains on text only"):
        refuse_images_here(job, build_processing("tiny-vl"), "rm")
    refuse_images_here(job, build_processing("tiny-vl"), "dpo")  # a processor that takes images: nothing to refuse
