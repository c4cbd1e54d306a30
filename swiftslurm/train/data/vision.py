"""Vision-language SFT data (issue 56): conversations with images, decoded and processed as the loader asks for them.

Records are the messages form with an ``images`` list (``images.py`` owns the contract: one ``<image>`` in the text
per image, in order; relative paths start at the data file's directory). Only the records' text and image paths are
held; an image is read, checked (``images.load_image``), brought within ``train.image_min_pixels`` ..
``image_max_pixels`` and run through the model's processor in ``VisionDataset.__getitem__``, that is in the
DataLoader's workers when ``train.dataloader_num_workers`` > 0, one sample at a time, and dropped with the batch.

Labels are the text path's (``tokens.encode``): every assistant turn trained on, the prompt -100. The processor then
expands each image placeholder into the image's tokens; those tokens are -100 too, and every other token keeps the
label its token had before the expansion (the expansion must leave the text tokens as they were, which is checked).
A sample longer than ``train.max_length`` loses its tail, unless the cut would fall into an image's tokens: then it
is refused (DataError naming the record): ``validate``'s scan holds each record's image tokens to ``max_length``, and
at start-up ``refuse_cuts`` finds such a record before the first step (its text tokenized, each image's tokens counted
from its header's size by the processor), where ``train.dataset_scan`` is on; otherwise when it is loaded.

Packing (``train.packing``, the text path's ``packing.PackedDataset``) for the models of ``vision.PACKS`` (their
image features are placed at the image tokens in the order they come): each record's length is counted before the
first step (``VisionDataset.lengths``: its text tokenized, each image's tokens from its header's size), the rows are
packed from those counts, and ``VisionPackingCollator`` gives a row its samples' tokens with their positions from 0
(no attention mask: transformers keeps the samples apart by their positions, as for text) and every image of the
batch's samples, in row order. LLaVA's language model takes those 1-D positions; Qwen2-VL's and Qwen2.5-VL's 3-D
rotary positions are each sample's own, computed by the model's own ``get_rope_index`` per sample (``RopeIndex``)
and given after the text positions. A processor whose sample then has another length than its count is refused
(DataError): a row could overflow. Other models train padded micro-batches, the reason in the log (``vision.fit_spec``).

Not here, and why: a cache of the processed samples (only the packed rows' counts are kept, ``counted_lengths``): the
processor runs per sample as its images are decoded, which costs about what the image decoding costs and needs no
cache to survive a requeue.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager

from ...sizing.vision import resized
from .images import IMAGE_PLACEHOLDER, BadImage, bad_image, image_paths, image_size, load_image
from .packing import PackedDataset, PackingCollator
from .records import DataError, read_records
from .tokens import IGNORE_INDEX, check_record, encode, ensure_chat_template

if TYPE_CHECKING:
    from ...spec.model import JobSpec

UNBOUNDED = 1 << 30  # tokens: tokens.encode cuts nothing; the cut is made after the images are expanded
HINT = "raise train.max_length, lower train.image_max_pixels, or put fewer images in a record"
# what a record's "<image>" becomes in the text the processor reads, for processors whose own placeholder is not one
# token standing alone (Qwen2-VL's chat template frames its image pad); every other processor: its ``image_token``
FRAMED_PLACEHOLDERS = {"Qwen2VLProcessor": "<|vision_start|><|image_pad|><|vision_end|>",
                       "Qwen2_5_VLProcessor": "<|vision_start|><|image_pad|><|vision_end|>"}


@dataclass(frozen=True)
class Conversation:
    """One record as held until it is asked for: its messages, its images' paths, and where it came from."""

    messages: list[dict[str, Any]]
    images: tuple[Path, ...]
    raw: tuple[Any, ...]  # the paths as the record wrote them (for messages)
    data_file: str
    where: str


def read_conversations(paths: list[str]) -> list[Conversation]:
    """Every record of every file, checked (the text as SFT checks it, the images' list and placeholder count as
    ``images.image_paths`` does), in file order. The images themselves are read when a sample is asked for."""
    out = []
    for path in paths:
        for where, rec in read_records(path):
            kind, body = check_record(Path(path), where, rec)
            if kind != "messages":
                raise DataError(f"{path}, {where}: a vision-language model trains on the messages form",
                                "an alpaca record", 'write it as {"messages": [...], "images": [...]}')
            images = image_paths(rec, path, where)
            out.append(Conversation(body, tuple(images), tuple(rec.get("images") or ()), path, where))
    if not out:
        raise DataError("the dataset holds no record", f"{len(paths)} file(s)", "check train.dataset")
    return out


def read_pairs(paths: list[str]) -> list[Conversation]:
    """The preference pairs with images of every file, each as the conversation its prompt and chosen answer make
    (``preference.check_record`` checked them): what ``VisionDataset.refuse_cuts`` measures, since the images stand
    in the prompt, which TRL's collator keeps first when it cuts at ``max_length``."""
    from .preference import check_record as check_pair

    out = []
    for path in paths:
        for where, rec in read_records(path):
            check_pair(Path(path), where, rec)
            images = image_paths(rec, path, where)
            if images:
                out.append(Conversation(list(rec["prompt"]) + list(rec["chosen"]), tuple(images), tuple(rec["images"]), path, where))
    return out


def anchored(record: Any, data_file: str | Path) -> Any:
    """``record`` with its relative image paths joined to ``data_file``'s directory, for a copy of it written
    elsewhere (``evaluation.split_files``); any other record, and any other entry, as it is."""
    images = record.get("images") if isinstance(record, dict) else None
    if not isinstance(images, list) or not images:
        return record
    return {**record, "images": [_anchor(item, Path(data_file).parent) for item in images]}


def _anchor(item: Any, base: Path) -> Any:
    relative = isinstance(item, str) and item and "://" not in item and not item.startswith(("~", "data:", "/"))
    return str(base / item) if relative else item


def within_bounds(width: int, height: int, min_pixels: int, max_pixels: int) -> tuple[int, int] | None:
    """The size an image of ``width`` x ``height`` is resized to before the processor, or None when its area lies in
    [min_pixels, max_pixels] already (the processor then sees it as it is): the size ``validate`` and ``plan`` count
    (``sizing.vision.resized``)."""
    if min_pixels <= width * height <= max_pixels:
        return None
    return resized(width, height, min_pixels, max_pixels)


def fitted(image: Any, min_pixels: int, max_pixels: int) -> Any:
    """``image`` resized into [min_pixels, max_pixels] (``within_bounds``), or as it is where it lies there."""
    width, height = image.size
    size = within_bounds(width, height, min_pixels, max_pixels)
    return image if size is None else image.resize(size)


def placeholder_of(processor: Any) -> str:
    return FRAMED_PLACEHOLDERS.get(type(processor).__name__, processor.image_token)


class VisionDataset:
    """Map-style: item ``i`` is record ``i`` with its images decoded and processed (see the module)."""

    def __init__(self, records: list[Conversation], processor: Any, max_length: int, min_pixels: int, max_pixels: int) -> None:
        self.records, self.processor, self.max_length = records, processor, max_length
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.image_token_id = int(processor.tokenizer.convert_tokens_to_ids(processor.image_token))
        self.placeholder = placeholder_of(processor)
        self.counted: list[int] | None = None  # ``lengths``: each sample's tokens as counted ahead (packing holds them)

    def __len__(self) -> int:
        return len(self.records)

    def image(self, rec: Conversation, index: int) -> Any:
        try:
            image = load_image(rec.images[index])
        except BadImage as exc:
            raise bad_image(rec.data_file, rec.where, index + 1, rec.raw[index], rec.images[index], exc) from None
        return fitted(image, self.min_pixels, self.max_pixels)

    def __getitem__(self, i: int) -> dict[str, Any]:
        rec = self.records[i]
        images = [self.image(rec, k) for k in range(len(rec.images))]
        messages = self._messages(rec)
        tok = self.processor.tokenizer
        plain = encode("messages", messages, tok, UNBOUNDED)
        if plain is None:
            raise DataError(f"{rec.data_file}, {rec.where}: no assistant token to train on", "", "check the record")
        text = tok.apply_chat_template(messages, tokenize=False)
        out = self.processor(text=[text], images=images or None, add_special_tokens=False, return_tensors="pt")
        ids = out["input_ids"][0].tolist()
        sample = {"input_ids": ids, "labels": self._labels(rec, plain, ids)}
        for key, value in out.items():  # the processor's other outputs: per token (a mask) or per image (pixels)
            if key != "input_ids":
                sample[key] = value[0].tolist() if _per_token(value, len(ids)) else value
        sample = self._cut(rec, sample)
        if self.counted is not None and len(sample["input_ids"]) != self.counted[i]:
            raise DataError(f"{rec.data_file}, {rec.where}: the processor gave {len(sample['input_ids'])} tokens where its "
                            f"count said {self.counted[i]}, so the packed rows do not hold", type(self.processor).__name__,
                            "set train.packing = false for this model, and report it")
        return sample

    def _messages(self, rec: Conversation) -> list[dict[str, Any]]:
        """The record's messages with each ``<image>`` written as this processor's placeholder."""
        return [{**m, "content": m["content"].replace(IMAGE_PLACEHOLDER, self.placeholder)} for m in rec.messages]

    def _labels(self, rec: Conversation, plain: dict[str, list[int]], ids: list[int]) -> list[int]:
        """The expanded sequence's labels: image tokens -100, every other token its label before the expansion."""
        image = self.image_token_id
        kept = [(t, lab) for t, lab in zip(plain["input_ids"], plain["labels"], strict=True) if t != image]
        text = [j for j, t in enumerate(ids) if t != image]
        if [ids[j] for j in text] != [t for t, _ in kept]:
            raise DataError(f"{rec.data_file}, {rec.where}: the processor changed the text's tokens beside the images",
                            type(self.processor).__name__, "report it: this model's processor is not one we can label")
        labels = [IGNORE_INDEX] * len(ids)
        for j, (_, lab) in zip(text, kept, strict=True):
            labels[j] = lab
        return labels

    def _cut(self, rec: Conversation, sample: dict[str, Any]) -> dict[str, Any]:
        ids = sample["input_ids"]
        if len(ids) <= self.max_length:
            return sample
        images = sum(t == self.image_token_id for t in ids)
        if sum(t == self.image_token_id for t in ids[: self.max_length]) < images:
            raise self._cut_error(rec, len(ids), images)
        return {k: v[: self.max_length] if isinstance(v, list) else v for k, v in sample.items()}

    def _cut_error(self, rec: Conversation, length: int, image_tokens: int) -> DataError:
        return DataError(f"{rec.data_file}, {rec.where}: {length} tokens with its images, and train.max_length = "
                         f"{self.max_length} would cut into an image's {image_tokens} token(s)", f"images {list(rec.raw)}"[:160], HINT)

    def _expanded(self, rec: Conversation, count: Any) -> int:
        """``rec``'s tokens with its images expanded, counted without decoding an image: its text tokenized, each
        image's tokens from its header's size brought within the pixel bounds, through the processor's own count
        (``count``: ``_get_num_multimodal_tokens``). A record whose ``max_length`` cut would fall into an image's tokens
        is refused as ``_cut`` refuses it when loaded (DataError naming it), one without an assistant token as
        ``__getitem__`` does."""
        sizes = []
        for k, path in enumerate(rec.images):
            try:
                width, height = image_size(path)
            except BadImage as exc:
                raise bad_image(rec.data_file, rec.where, k + 1, rec.raw[k], path, exc) from None
            width, height = within_bounds(width, height, self.min_pixels, self.max_pixels) or (width, height)
            sizes.append([height, width])
        tokens = list(count(image_sizes=sizes).num_image_tokens) if sizes else []
        plain = encode("messages", self._messages(rec), self.processor.tokenizer, UNBOUNDED)
        if plain is None:
            raise DataError(f"{rec.data_file}, {rec.where}: no assistant token to train on", "", "check the record")
        length = end = 0  # the expanded sequence's length, and where its last image's tokens end
        pending = list(tokens)
        for t in plain["input_ids"]:
            if t == self.image_token_id and pending:
                length += pending.pop(0)
                end = length
            else:
                length += 1
        if end > self.max_length:
            raise self._cut_error(rec, length, sum(tokens))
        return length

    def refuse_cuts(self) -> int:
        """Before the first step: the first record whose ``max_length`` cut would fall into an image's tokens, refused
        (``_expanded``); a processor without its own token count leaves the check to ``_cut``. Returns the records
        checked."""
        count = getattr(self.processor, "_get_num_multimodal_tokens", None)
        if count is None:
            return 0
        for rec in self.records:
            if rec.images:
                self._expanded(rec, count)
        return sum(1 for rec in self.records if rec.images)

    def lengths(self) -> list[int]:
        """Each sample's tokens as ``__getitem__`` will give them (after the ``max_length`` cut), counted ahead for the
        packed rows (``_expanded``; the refusals of ``refuse_cuts`` on the way), or the counts ``counted_lengths``
        read back; held, and each loaded sample held to its count. Needs the processor's own count (``vision.PACKS``
        lists only processors that have one)."""
        if self.counted is None:
            count = self.processor._get_num_multimodal_tokens
            self.counted = [min(self._expanded(rec, count), self.max_length) for rec in self.records]
        return self.counted

    def counts_key(self, paths: list[str], counts_dir: str | Path) -> str:
        """What the counts depend on: the data files' bytes (``cache.dataset_digest``), the tokenizer, the processor
        and its image settings, ``max_length`` and the pixel bounds. Not the images' bytes: an image changed in place
        is found when it is loaded (``__getitem__`` holds each sample to its count)."""
        import hashlib
        import json

        from .cache import dataset_digest, tokenizer_fingerprint

        image_processor: Any = getattr(self.processor, "image_processor", None)
        body = {"format": COUNTS_FORMAT, "files": [dataset_digest(p, counts_dir) for p in paths],
                "tokenizer": tokenizer_fingerprint(self.processor.tokenizer), "processor": type(self.processor).__name__,
                "images": image_processor.to_json_string() if hasattr(image_processor, "to_json_string") else "",
                "placeholder": self.placeholder, "max_length": self.max_length, "pixels": [self.min_pixels, self.max_pixels]}
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:24]


COUNTS_FORMAT = 1


def counted_lengths(dataset: VisionDataset, paths: list[str], counts_dir: str | Path) -> list[int]:
    """``dataset.lengths()``, read from ``counts_dir`` (the task dir's ``taskdir.VL_LENGTHS_DIR``) where a run wrote the
    counts of the same data (``counts_key``), else counted and written there (``<key>.i32``: int32, one a record,
    written whole under a temporary name and renamed). A file under the name that is not one count a record (another
    size, a count outside 1..max_length), or a link, is counted again and replaced (a link itself, never what it
    points to). Callers run rank 0 first (``main_process_first``): one rank counts, the others and every requeue read."""
    import numpy as np

    from ...fsutil import Unreadable, atomic_write_bytes, read_bytes

    path = Path(counts_dir) / f"{dataset.counts_key(paths, counts_dir)}.i32"
    n = len(dataset.records)
    try:
        found = np.frombuffer(read_bytes(path, 4 * n, follow_symlinks=False), dtype="<i4")
    except (FileNotFoundError, Unreadable):
        found = None
    if found is not None and len(found) == n and n and int(found.min()) >= 1 and int(found.max()) <= dataset.max_length:
        dataset.counted = found.tolist()
        return dataset.counted
    counts = dataset.lengths()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, np.asarray(counts, dtype="<i4").tobytes())
    except OSError:
        pass  # the next start counts again: slower, never wrong
    return counts


def _per_token(value: Any, length: int) -> bool:
    return getattr(value, "ndim", 0) == 2 and value.shape[0] == 1 and value.shape[1] == length


class VisionCollator:
    """Right-pads the per-token lists (input_ids with the pad id, labels with -100, masks with 0) and concatenates the
    per-image tensors of the batch's samples in order (pixel_values, image sizes or grids): the model places the
    images' features at its image tokens in that order. A batch without any image has no image tensors."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        width = max(len(ex["input_ids"]) for ex in batch)
        fill = {"input_ids": self.pad_id, "labels": IGNORE_INDEX}
        out: dict[str, Any] = {}
        for key in batch[0]:
            values = [ex[key] for ex in batch if key in ex]
            if isinstance(values[0], list):
                out[key] = torch.tensor([v + [fill.get(key, 0)] * (width - len(v)) for v in values], dtype=torch.long)
        out.update(image_tensors(batch))
        return out


def image_tensors(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-image tensors of ``samples`` (pixel values, image sizes or grids), each key concatenated in the samples'
    order: the model places the images' features at its image tokens in that order. Empty without an image."""
    import torch

    keys = sorted({k for ex in samples for k, v in ex.items() if not isinstance(v, list)})
    return {key: torch.cat([ex[key] for ex in samples if key in ex]) for key in keys}


class RopeIndex:
    """A model's own multimodal positions (``get_rope_index``: Qwen2-VL's 3-D rotary positions, temporal, height and
    width) for one sample at a time, away from the model: an empty instance of the model's class that holds only its
    config (the method reads nothing else of it), so the collator can run it in the DataLoader's workers. The
    positions are transformers' own; tests/test_vl.py holds a packed row's logits to each sample's alone."""

    def __init__(self, module: Any, image_token_id: int) -> None:
        import torch

        cls: Any = type(module)
        self.shim = cls.__new__(cls)
        torch.nn.Module.__init__(self.shim)
        self.shim.config = module.config
        self.image_token_id = image_token_id

    def __call__(self, ids: list[int], grids: Any) -> Any:
        """(3, len(ids)) positions of one sample; ``grids``: its ``image_grid_thw`` (None without images)."""
        import torch

        if grids is None or not len(grids):
            return torch.arange(len(ids)).expand(3, -1)
        t = torch.tensor([ids])
        positions, _ = self.shim.get_rope_index(t, (t == self.image_token_id).int(), image_grid_thw=grids)
        return positions[:, 0]


def rope_index(model: Any, image_token_id: int) -> RopeIndex | None:
    """The ``RopeIndex`` of a model whose positions are computed per sequence (a module whose class has
    ``get_rope_index``, Qwen2-VL's and Qwen2.5-VL's), else None (1-D positions: LLaVA)."""
    for module in model.modules() if model is not None else ():
        if callable(getattr(type(module), "get_rope_index", None)) and hasattr(module, "config"):
            return RopeIndex(module, image_token_id)
    return None


class VisionPackingCollator(PackingCollator):
    """Packed rows of vision-language samples: the text path's rows (``PackingCollator``: tokens, labels, positions
    from 0 per sample, no attention mask) and every image tensor of the batch's samples concatenated in row order, the
    order their image tokens come in the rows. ``rope`` (a model with multimodal positions): ``position_ids`` are
    ``[4, rows, length]``, the text positions first (transformers keeps the samples apart by them) and then each
    sample's own 3-D positions, as transformers' Qwen2-VL reads packed rows."""

    def __init__(self, max_length: int, pad_id: int, flatten: bool = False, boundaries: bool = False,
                 rope: RopeIndex | None = None) -> None:
        super().__init__(max_length, pad_id, flatten, boundaries)
        self.rope = rope

    def __call__(self, batch: list[list[dict[str, Any]]]) -> dict[str, Any]:
        import torch

        out = super().__call__(batch)
        out.update(image_tensors([ex for row in batch for ex in row]))
        if self.rope is not None:
            text = out["position_ids"]
            rows = []
            for row in batch:
                parts = [self.rope(ex["input_ids"], ex.get("image_grid_thw")) for ex in row]
                pad = self.max_length - sum(p.shape[1] for p in parts)
                rows.append(torch.cat([*parts, torch.arange(pad).expand(3, -1)], 1))
            multimodal = torch.stack(rows, 1).reshape(3, *text.shape).to(text.dtype)
            out["position_ids"] = torch.cat([text[None], multimodal])
        return out


def templated(processor: Any) -> Any:
    """The processor's tokenizer, holding the chat template (the processor's own where the tokenizer has none): the
    labels' spans and the pairs' text come from the tokenizer's rendering."""
    tok = processor.tokenizer
    if tok.chat_template is None and getattr(processor, "chat_template", None):
        tok.chat_template = processor.chat_template
    ensure_chat_template(tok)
    return tok


def vision_data(spec: JobSpec, processor: Any, model: Any = None, attn: str = "sdpa", counts_dir: str | Path | None = None,
                first: Callable[[], ContextManager[Any]] = nullcontext) -> tuple[Any, Any]:
    """(train dataset, collator) of ``spec.train.dataset`` for a vision-language model's ``processor``: packed rows
    where ``train.packing`` is on (``vision.fit_spec`` left it on only for a model that packs; ``model`` then trains
    without a KV cache, ``attn`` picks the rows' form as for text), else padded micro-batches. ``counts_dir``: where
    the packed rows' counts are kept (``counted_lengths``), ``first`` the context that runs rank 0 first (the
    TrainingArguments' ``main_process_first``)."""
    t = spec.train
    tok = templated(processor)
    dataset = VisionDataset(read_conversations(list(t.dataset)), processor, t.max_length, t.image_min_pixels, t.image_max_pixels)
    if t.packing:
        from ..kernels import choose as kernels
        from .packing import prepare_model

        if model is not None:
            prepare_model(model)
        if counts_dir is not None:
            with first():
                counted_lengths(dataset, list(t.dataset), counts_dir)
        rows = PackedDataset(dataset, t.max_length, t.seed)  # counts every record (VisionDataset.lengths), refusals on the way
        return rows, VisionPackingCollator(t.max_length, tok.pad_token_id, flatten=attn.startswith("flash_attention"),
                                           boundaries=attn == kernels.VARLEN, rope=rope_index(model, dataset.image_token_id))
    if t.dataset_scan:  # a record the cut would refuse mid-run, refused before the first step (refuse_cuts)
        dataset.refuse_cuts()
    return dataset, VisionCollator(tok.pad_token_id)


def preference_collator(processor: Any, t: Any) -> Any:
    """DPO on a vision-language model (``task = "dpo"``, records with images): TRL's ``DataCollatorForVisionPreference``,
    given each pair as this module gives SFT its samples. A record holds its images' paths (``preference.load``);
    here, per micro-batch, each image is read through ``images.load_image``'s checks and brought within
    ``image_min_pixels`` .. ``image_max_pixels``, each ``<image>`` of the prompt becomes the processor's placeholder
    where the record put it, and the pair is rendered with the chat template as text (TRL's own conversational path
    would put every image before the first user message). TRL's collator then runs the processor and cuts at
    ``max_length`` from the end (its ``keep_start``: the prompt's images come first); a pair whose cut would fall into
    an image's tokens is refused before the first step (``read_pairs``, ``VisionDataset.refuse_cuts``), where
    ``train.dataset_scan`` is on."""
    from trl.data_utils import apply_chat_template
    from trl.trainer.dpo_trainer import DataCollatorForVisionPreference

    tok = templated(processor)
    if tok.pad_token is None:  # TRL's own collator path does the same
        tok.pad_token = tok.eos_token
    placeholder = placeholder_of(processor)

    def image(path: str) -> Any:
        try:
            return fitted(load_image(path), t.image_min_pixels, t.image_max_pixels)
        except BadImage as exc:
            raise DataError(f"{path}: {exc.why}", "an image of train.dataset, read for a micro-batch", exc.hint or
                            "`swiftslurm validate` checks every image; replace the file") from None

    class VisionPreferenceCollator(DataCollatorForVisionPreference):
        def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
            ready = []
            for ex in examples:
                prompt = [{**m, "content": m["content"].replace(IMAGE_PLACEHOLDER, placeholder)} for m in ex["prompt"]]
                text = apply_chat_template({"prompt": prompt, "chosen": ex["chosen"], "rejected": ex["rejected"]}, tok)
                ready.append({**text, "images": [image(p) for p in ex.get("images") or []]})
            return super().torch_call(ready)

    if t.dataset_scan:  # a pair whose cut at max_length would fall into an image's tokens, refused before the first step
        VisionDataset(read_pairs(list(t.dataset)), processor, t.max_length, t.image_min_pixels, t.image_max_pixels).refuse_cuts()
    return VisionPreferenceCollator(processor=processor, max_length=t.max_length)
