"""Images in training records: the one contract that validate's scan and the training side both read.

A record with images is the messages form with an ``images`` list (the shape LLaMA-Factory and ms-swift take)::

    {"messages": [{"role": "user", "content": "<image>What is in the picture?"},
                  {"role": "assistant", "content": "A red square."}],
     "images": ["img/square.png"]}

- Each image stands in the text as one ``<image>`` (``IMAGE_PLACEHOLDER``), in the order of ``images``; over all
  messages the placeholders number exactly ``len(images)`` (LLaMA-Factory's rule). A preference pair (DPO) holds
  them in its ``prompt`` messages (``IMAGE_TEXT_KEYS``). ``images`` absent or empty: a
  text-only record. In a dataset without any image, ``<image>`` is plain text (the count is checked once the
  dataset has an image record).
- ``images`` is a list of local paths (strings). A relative path is relative to the directory of the data file
  that holds the record, never to the current directory; an absolute path is taken as it is. URLs are refused.
- An image is a regular file (a FIFO or device is refused without blocking: a file we did not write is data,
  never code), at most ``IMAGE_CAP`` bytes, in one of ``SUPPORTED_FORMATS``, at most ``MAX_DECODE_PIXELS`` pixels
  (a decompression bomb is refused from its header, before any pixel is decoded), that Pillow decodes whole.

For the training side::

    paths = image_paths(record, data_file, where)   # resolved; DataError "<file>, line N: ..." when malformed
    placeholder_count(record)                        # the <image> placeholders of its messages
    image = load_image(path)                         # a PIL RGB image, through the same checks (BadImage: why)

``check_image(path)`` runs the checks without keeping the pixels (``ImageInfo``); ``ImageScan`` is validate's pass
over a dataset's records (``tokens.count_records``). Pillow comes with the ``train`` extra; where it is missing, a
dataset with images is refused with that hint. Nothing here loads a model or a processor.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ...fsutil import MIB, Unreadable, read_bytes
from ...sizing.vision import MAX_ASPECT, QWEN_RULE, ImageFacts, TokenRule, text_only
from .records import IMAGE_PLACEHOLDER, DataError

if TYPE_CHECKING:
    from PIL.Image import Image

SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # Pillow's format names
IMAGE_CAP = 64 * MIB  # bytes of one image file: a photo is a few MiB; more is not an image to train on
MAX_DECODE_PIXELS = 64 * MIB  # pixels of one image (8192 x 8192): more is refused from the header, never decoded
RESIZE_HINT = "resize it: the processor scales it down to train.image_max_pixels anyway"
RECORD_HINT = ('a record with images is {"messages": [...], "images": ["path.png", ...]} (a preference pair: its "prompt" '
               'messages hold the "<image>"s), one "<image>" in the text per image, in order; relative paths start at the '
               "data file's directory")


class BadImage(ValueError):
    """An image file that cannot be used; ``why`` says what was found (the caller names the record)."""

    def __init__(self, why: str, hint: str = "") -> None:
        self.why, self.hint = why, hint
        super().__init__(why)


@dataclass(frozen=True)
class ImageInfo:
    format: str  # Pillow's name: "PNG", "JPEG", ...
    width: int
    height: int


def _at(data_file: str | Path, where: str) -> str:
    return f"{data_file}, {where}" if where else str(data_file)


# where a record's images stand in its text: SFT's messages, or a conversational preference pair's prompt (the pair's
# answers are text: an image belongs to what is asked)
IMAGE_TEXT_KEYS = ("messages", "prompt")


def placeholder_count(record: Mapping[str, Any]) -> int:
    """The ``<image>`` placeholders over all of a record's messages (``IMAGE_TEXT_KEYS``; 0 for a record without)."""
    messages = next((record[k] for k in IMAGE_TEXT_KEYS if isinstance(record.get(k), list)), None)
    if messages is None:
        return 0
    return sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages
               if isinstance(m, dict) and isinstance(m.get("content"), str))


def image_paths(record: Mapping[str, Any], data_file: str | Path, where: str = "") -> list[Path]:
    """The record's images as paths (relative ones joined to ``data_file``'s directory), in order; [] for a
    text-only record. DataError naming ``data_file`` and ``where`` ("line N") when ``images`` is malformed, when the
    record is not the messages form, or when its ``<image>`` placeholders do not number its images."""
    raw = record.get("images")
    if raw is None or raw == []:
        return []
    at = _at(data_file, where)
    if not isinstance(raw, list):
        raise DataError(f"{at}: 'images' must be a list of paths", repr(raw)[:80], RECORD_HINT)
    if not any(isinstance(record.get(k), list) for k in IMAGE_TEXT_KEYS):
        raise DataError(f"{at}: a record with images must be in the messages form", f"keys {sorted(record)[:6]}", RECORD_HINT)
    base = Path(data_file).parent
    out = []
    for i, item in enumerate(raw, 1):
        if not isinstance(item, str) or not item.strip():
            raise DataError(f"{at}: image {i} of 'images' is not a path", repr(item)[:80],
                            "each entry of 'images' is a path string; image bytes or objects are not read")
        if "://" in item or item.startswith("data:"):
            raise DataError(f"{at}: image {i} is a URL, not a local file", item[:120],
                            "download the images and name their paths (relative to the data file's directory)")
        if "\0" in item:
            raise DataError(f"{at}: image {i}'s path holds a NUL byte", repr(item)[:120], "name the file's path")
        path = Path(item).expanduser() if item.startswith("~") else Path(item)
        out.append(path if path.is_absolute() else base / path)
    count = placeholder_count(record)
    if count != len(out):
        raise DataError(f"{at}: {count} {IMAGE_PLACEHOLDER} placeholder(s) in the messages for {len(out)} image(s)",
                        f"images {raw}"[:160], f"put one {IMAGE_PLACEHOLDER} in the text where each image goes, in order")
    return out


TEXT_MODEL_HINT = ("set train.model to a vision-language model (its processor takes images; `tiny-vl` is the built-in "
                   "one), or drop the records' images")


def text_task_hint() -> str:
    """The way out for records with images in a task that trains on text only."""
    from ...tasks import TASKS

    able = ", ".join(repr(n) for n, row in TASKS.items() if row.images)
    return f"use task = {able} with a vision-language model, or drop the images"


def refuse_images(record: Any, data_file: str | Path, where: str, task: str) -> None:
    """A record with images in the data of ``task``, which trains on text only (PT, KTO, GRPO, RM): refused, never
    trained without its images (DataError naming the file and line)."""
    if isinstance(record, dict) and record.get("images"):
        raise DataError(f"{_at(data_file, where)}: a record with images, and train.task = {task!r} trains on text only",
                        f"images {record['images']}"[:120], text_task_hint())


def _pillow() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise DataError("records with images need Pillow to read them, which is not installed", "import PIL failed",
                        "pip install 'swiftslurm[train]' (or pillow)") from None
    return Image


def _open(path: Path, max_bytes: int, max_pixels: int) -> Image:
    """The image at ``path`` opened from its bytes (read through fsutil: regular file, size cap), its format and
    size checked from the header; nothing decoded yet. BadImage: why."""
    Image = _pillow()
    try:
        data = read_bytes(path, max_bytes)
    except FileNotFoundError:
        raise BadImage("does not exist", "check the path; a relative one starts at the data file's directory") from None
    except Unreadable as exc:
        raise BadImage(f"is {exc.why}", f"an image is a regular file of at most {max_bytes:,} bytes") from None
    try:
        with warnings.catch_warnings():  # Pillow warns of a decompression bomb: refused just below, by our own cap
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=SUPPORTED_FORMATS)
    except Image.DecompressionBombError:  # past twice Pillow's own limit, which is above ours
        raise BadImage(f"is over {max_pixels:,} pixels, the cap on an image to decode (Pillow calls it a decompression "
                       "bomb)", RESIZE_HINT) from None
    except Exception:  # noqa: BLE001 -- Pillow's errors for bytes that are no image of these formats: one verdict
        raise BadImage(f"is not a {', '.join(SUPPORTED_FORMATS[:-1])} or {SUPPORTED_FORMATS[-1]} image "
                       f"(it starts with {data[:12]!r})", "convert it to PNG or JPEG") from None
    width, height = image.size
    if width * height > max_pixels:
        raise BadImage(f"is {width} x {height} = {width * height:,} pixels, over {max_pixels:,}, the cap on an image "
                       "to decode", RESIZE_HINT)
    if max(width, height) > MAX_ASPECT * min(width, height):
        raise BadImage(f"is {width} x {height} pixels, more than {MAX_ASPECT} times as long as it is wide, which vision "
                       "processors refuse", "crop or pad the image")
    return image


def _decode(image: Image, path: Path) -> None:
    try:
        image.load()
    except Exception as exc:  # noqa: BLE001 -- a truncated or damaged stream: Pillow raises OSError, ValueError, ...
        raise BadImage(f"cannot be decoded: {str(exc) or type(exc).__name__}"[:200],
                       "the file is damaged or truncated; write it again") from None


EXIF_ORIENTATION = 0x0112  # 5..8: the picture is stored turned a quarter (a phone's portrait JPEG): width and height swap


def upright_size(image: Image) -> tuple[int, int]:
    """(width, height) of ``image`` as it is shown: its EXIF orientation applied, read from the header (``load_image``
    turns the pixels the same way, as transformers' own ``load_image`` does)."""
    width, height = image.size
    try:
        turned = image.getexif().get(EXIF_ORIENTATION) in (5, 6, 7, 8)
    except Exception:  # noqa: BLE001 -- a damaged EXIF block: the image as stored
        turned = False
    return (height, width) if turned else (width, height)


def check_image(path: str | Path, *, max_bytes: int = IMAGE_CAP, max_pixels: int = MAX_DECODE_PIXELS) -> ImageInfo:
    """``path`` is an image that training can use: a regular file of at most ``max_bytes``, one of
    ``SUPPORTED_FORMATS``, at most ``max_pixels`` pixels, decoded whole (a JPEG at 1/8 scale: every byte of its stream
    is still read). BadImage: why (the caller names the record); DataError when Pillow is missing."""
    p = Path(path)
    with _open(p, max_bytes, max_pixels) as image:
        info = ImageInfo(str(image.format), *upright_size(image))
        if image.format == "JPEG":
            image.draft("RGB", (max(1, info.width // 8), max(1, info.height // 8)))
        _decode(image, p)
    return info


def image_size(path: str | Path, *, max_bytes: int = IMAGE_CAP, max_pixels: int = MAX_DECODE_PIXELS) -> tuple[int, int]:
    """(width, height) from the image's header (``upright_size``), through the same checks, nothing decoded."""
    return upright_size(_open(Path(path), max_bytes, max_pixels))


def load_image(path: str | Path, *, max_bytes: int = IMAGE_CAP, max_pixels: int = MAX_DECODE_PIXELS) -> Image:
    """The image at ``path`` as an RGB Pillow image shown upright (its EXIF orientation applied), through the checks
    of ``check_image`` (BadImage: why)."""
    from PIL import ImageOps

    p = Path(path)
    image = _open(p, max_bytes, max_pixels)
    _decode(image, p)
    try:
        image = ImageOps.exif_transpose(image)
    except Exception:  # noqa: BLE001 -- a damaged EXIF block: the image as stored (upright_size says the same)
        pass
    return _rgb(image)


def _rgb(image: Image) -> Image:
    """``image`` in RGB as transformers' processors make it (``convert_to_rgb``): transparency composited over white.
    A 16-bit grayscale image (PNG, TIFF: Pillow's modes ``I;16*`` and ``I``) is scaled to 8 bits first: Pillow's own
    conversion clips its values at 255, which turns anything but the darkest 0.4% of its range white."""
    from PIL import Image as PILImage

    if image.mode == "RGB":
        return image
    if image.mode.startswith("I;16") or image.mode == "I":
        image = image.convert("I").point(lambda v: v * (1 / 257)).convert("L")  # 0..65535 -> 0..255
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        over = PILImage.new("RGBA", image.size, (255, 255, 255, 255))
        return PILImage.alpha_composite(over, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def bad_image(data_file: str | Path, where: str, index: int, raw: Any, path: Path, exc: BadImage) -> DataError:
    """A BadImage as the one message of its record: ``<file>, line N: image 2 ('a.png') <why>``."""
    return DataError(f"{_at(data_file, where)}: image {index} ({raw!r}) {exc.why}", str(path), exc.hint)


@dataclass
class ImageScan:
    """Validate's pass over a dataset's images, record by record (``check``), then ``facts()``: every image checked
    once however many records name it, each record's placeholders counted against its images, the tokens its images
    take (at ``min_pixels``..``max_pixels``) held to ``max_length``, and the resolution bound itself."""

    max_length: int
    min_pixels: int
    max_pixels: int
    rule: TokenRule = QWEN_RULE  # the model's (sizing.vision.token_rule)
    seen: dict[Path, ImageInfo] = field(default_factory=dict)
    records: int = 0
    images: int = 0
    max_per_record: int = 0
    max_tokens: int = 0
    largest: tuple[int, int] = (0, 0)
    stray: str = ""  # the first text-only record with <image> in its text: refused once the dataset has an image

    def check(self, record: Any, data_file: str | Path, where: str) -> None:
        if not isinstance(record, dict):
            return
        paths = image_paths(record, data_file, where)
        if not paths:
            count = placeholder_count(record)
            if count and not self.stray:
                self.stray = f"{_at(data_file, where)}: {count} {IMAGE_PLACEHOLDER} placeholder(s) in a record without images"
            self._refuse_stray()
            return
        if not self.records:
            self._check_bound(data_file, where)
        tokens = 0
        for i, (raw, path) in enumerate(zip(record["images"], paths, strict=True), 1):
            info = self.seen.get(path)
            if info is None:
                try:
                    info = check_image(path)
                except BadImage as exc:
                    raise bad_image(data_file, where, i, raw, path, exc) from None
                self.seen[path] = info
            tokens += self.rule.tokens(info.width, info.height, self.min_pixels, self.max_pixels)
            if info.width * info.height > self.largest[0] * self.largest[1]:
                self.largest = (info.width, info.height)
        if tokens > self.max_length:
            raise DataError(f"{_at(data_file, where)}: its {len(paths)} image(s) take {tokens:,} tokens, more than "
                            f"train.max_length = {self.max_length:,}", f"images {record['images']}"[:160],
                            "fewer images a record, a lower train.image_max_pixels, or a higher train.max_length")
        self.records += 1
        self.images += len(paths)
        self.max_per_record = max(self.max_per_record, len(paths))
        self.max_tokens = max(self.max_tokens, tokens)
        self._refuse_stray()

    def _check_bound(self, data_file: str | Path, where: str) -> None:
        bad = self.rule.bound_problem(self.max_pixels, self.max_length)
        if bad:
            raise DataError(bad[0], f"the dataset holds images ({_at(data_file, where)} is its first record with one)", bad[1])

    def _refuse_stray(self) -> None:
        if self.stray and self.records:
            raise DataError(self.stray, "the dataset has records with images, where <image> stands for an image",
                            f"add the record's 'images', or take {IMAGE_PLACEHOLDER} out of its text")

    def refuse_for_text(self, model: str | None, data_file: str | Path, where: str) -> None:
        """A record with images (the one just checked) for a model known to take text only (``text_only``)."""
        if self.records == 1 and text_only(model):
            raise DataError(f"{_at(data_file, where)}: a record with images, and train.model = {model!r} takes text only",
                            "its first record with images", TEXT_MODEL_HINT)

    def facts(self) -> ImageFacts | None:
        """What the scan found, or None for a dataset without images."""
        if not self.records:
            return None
        return ImageFacts(self.records, self.images, self.max_per_record, self.max_tokens, self.largest)



@dataclass(frozen=True)
class Scanned:
    """What a data module's ``count_records`` found when it checks images too (a bare int count otherwise)."""

    count: int
    images: ImageFacts | None = None
