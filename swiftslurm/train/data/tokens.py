"""SFT data: alpaca or messages records (read by ``records``: JSONL, JSON, parquet, arrow, a
``save_to_disk`` directory) -> token ids with the prompt masked out.

- alpaca: ``{"instruction": str, "input": str (optional), "output": str}``
- messages: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``

Only the response tokens (alpaca ``output``, every ``assistant`` turn) carry labels; everything else
is -100. Examples are truncated to ``max_length`` tokens; an example left without any label token
is dropped (and counted). A malformed record raises ``DataError`` naming the file and line (row index
for columnar files).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from .records import DataError, count_checked, read_records  # noqa: F401  (DataError: re-exported for callers of this module)

if TYPE_CHECKING:
    from .images import Scanned

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant", "tool")
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
ALPACA_PROMPT_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
DROPPED = "no response token left after max_length={max_length} truncation"  # why an example was dropped


def _bad(path: Path, where: str, what: str, found: str = "") -> DataError:
    return DataError(f"{path}, {where}: {what}", found,
                     'each record is {"instruction", "input", "output"} (alpaca) or '
                     '{"messages": [{"role", "content"}, ...]}')


def check_record(path: Path, line: str, rec: Any) -> tuple[str, Any]:
    """("alpaca", rec) or ("messages", messages), or a DataError naming what is wrong."""
    if not isinstance(rec, dict):
        raise _bad(path, line, "a record must be a JSON object", type(rec).__name__)
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise _bad(path, line, "'messages' must be a non-empty list", repr(msgs)[:80])
        for m in msgs:
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
                raise _bad(path, line, f"each message needs 'role' ({', '.join(ROLES)}) and a string 'content'", repr(m)[:80])
        if not any(m["role"] == "assistant" for m in msgs):
            raise _bad(path, line, "a conversation needs at least one assistant message to learn from")
        return "messages", msgs
    if "instruction" in rec or "output" in rec:
        for key in ("instruction", "output"):
            if not isinstance(rec.get(key), str):
                raise _bad(path, line, f"alpaca field '{key}' must be a string", repr(rec.get(key))[:80])
        if not isinstance(rec.get("input", ""), str):
            raise _bad(path, line, "alpaca field 'input' must be a string", repr(rec.get("input"))[:80])
        return "alpaca", rec
    raise _bad(path, line, "neither alpaca nor messages format", f"keys {sorted(rec)[:6]}")


def _label_spans(kind: str, rec: Any, tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """The full text of one example and the character spans that are trained on."""
    if kind == "alpaca":
        template = ALPACA_PROMPT_INPUT if rec.get("input") else ALPACA_PROMPT
        prompt = template.format(instruction=rec["instruction"], input=rec.get("input", ""))
        answer = rec["output"] + (tokenizer.eos_token or "")
        return prompt + answer, [(len(prompt), len(prompt) + len(answer))]
    def render(msgs: list[dict[str, Any]], gen: bool = False) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    text = render(rec)
    spans = []
    for i, m in enumerate(rec):
        if m["role"] != "assistant":
            continue
        prefix, upto = render(rec[:i], True) if i else "", render(rec[: i + 1])
        if text.startswith(upto) and upto.startswith(prefix):
            spans.append((len(prefix), len(upto)))
        else:  # a template that is not prefix-stable: fall back to locating the content itself
            start = text.find(m["content"], spans[-1][1] if spans else 0)
            if start >= 0:
                spans.append((start, start + len(m["content"])))
    return text, spans


def encode(kind: str, rec: Any, tokenizer, max_length: int) -> dict[str, list[int]] | None:
    """input_ids / labels / attention_mask of one record, or None when truncation left no label."""
    return encode_many([(kind, rec)], tokenizer, max_length)[0]


def encode_many(records: list[tuple[str, Any]], tokenizer, max_length: int) -> list[dict[str, list[int]] | None]:
    """``encode`` of each (kind, record), with one tokenizer call per kind of record instead of one per record
    (a fast tokenizer encodes a batch in Rust, in parallel): the same ids and labels, record by record."""
    prepared = [(kind == "alpaca", *_label_spans(kind, rec, tokenizer)) for kind, rec in records]
    out: list[dict[str, list[int]] | None] = [None] * len(prepared)
    for special in (True, False):  # chat templates carry their own special tokens; alpaca gets the tokenizer's
        which = [i for i, (add, _, _) in enumerate(prepared) if add == special]
        if not which:
            continue
        enc = tokenizer([prepared[i][1] for i in which], add_special_tokens=special, return_offsets_mapping=True)
        for j, i in enumerate(which):
            out[i] = _with_labels(enc["input_ids"][j], enc["offset_mapping"][j], prepared[i][2], max_length)
    return out


def _with_labels(all_ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]],
                 max_length: int) -> dict[str, list[int]] | None:
    import numpy as np  # here: `swiftslurm validate` checks records with this module on a light install

    ids = list(all_ids[:max_length])
    # a token is trained on when its first character lies in a span (numpy: this loop is most of the cost)
    starts = np.fromiter((start for start, _ in offsets[: len(ids)]), dtype=np.int64, count=len(ids))
    inside = np.zeros(len(ids), dtype=bool)
    for s, e in spans:
        inside |= (starts >= s) & (starts < e)
    if not inside.any():
        return None
    labels = np.where(inside, np.asarray(ids, dtype=np.int64), IGNORE_INDEX).tolist()
    return {"input_ids": ids, "labels": labels, "attention_mask": [1] * len(ids)}


@dataclass
class SFTDataset:
    """A list of encoded examples (a map-style dataset for the Trainer's DataLoader)."""

    examples: list[dict[str, list[int]]]
    dropped: int = 0

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.examples[i]

    def lengths(self) -> list[int]:
        return [len(ex["input_ids"]) for ex in self.examples]


def ensure_chat_template(tokenizer) -> None:
    """Tokenizers without a chat template (base models, the tiny one) get the tiny model's plain one."""
    if tokenizer.chat_template is None:
        from ..tinymodel import CHAT_TEMPLATE

        tokenizer.chat_template = CHAT_TEMPLATE


def checked_records(paths: list[str]) -> Iterator[tuple[str, Any]]:
    """(kind, body) of every record of every file, in file order, for a text model; a malformed one raises
    DataError, and so does a record with images (its images would be dropped: a vision-language model's records go
    through ``data/vision.py``)."""
    for path in paths:
        for line, rec in read_records(path):
            if isinstance(rec, dict) and rec.get("images"):
                from .images import TEXT_MODEL_HINT

                raise DataError(f"{path}, {line}: a record with images, and train.model takes text only",
                                f"images {rec['images']}"[:120], TEXT_MODEL_HINT)
            yield check_record(Path(path), line, rec)


def scan(paths: list[str]) -> int:
    """Every record of every file checked, nothing tokenized (the scan of ``validate``): the record count.
    A dataset without any record is a DataError too (training it would fail)."""
    return count_checked(checked_records(paths), paths)


def no_example_error(paths: list[str], dropped: int) -> DataError:
    return DataError("no trainable example in the dataset", f"{len(paths)} file(s), {dropped} dropped by max_length",
                     "check train.dataset, or raise train.max_length so responses are not cut off")


def load_dataset(paths: list[str], tokenizer, max_length: int) -> SFTDataset:
    """Read and encode every record of every file, in file order (the Trainer's sampler shuffles by seed)."""
    ensure_chat_template(tokenizer)
    examples, dropped = [], 0
    for kind, body in checked_records(paths):
        ex = encode(kind, body, tokenizer, max_length)
        if ex is None:
            dropped += 1
        else:
            examples.append(ex)
    if not examples:
        raise no_example_error(paths, dropped)
    return SFTDataset(examples, dropped)


class Collator:
    """Right-pads a batch: input_ids with the pad id, labels with -100, attention_mask with 0. For sequence
    parallel (``fixed_width``): every batch padded to that width, with ``position_ids`` (0.. per row): the
    Ulysses adapter gathers the batches of an SP group's ranks, which must then have one shape."""

    def __init__(self, pad_id: int, fixed_width: int | None = None) -> None:
        self.pad_id = pad_id
        self.fixed_width = fixed_width

    def __call__(self, batch: list[dict[str, list[int]]]) -> dict[str, Any]:
        import torch

        width = self.fixed_width or max(len(ex["input_ids"]) for ex in batch)
        out: dict[str, list[Any]] = {"input_ids": [], "labels": [], "attention_mask": []}
        if self.fixed_width:
            out["position_ids"] = [list(range(width)) for _ in batch]
        for ex in batch:
            pad = width - len(ex["input_ids"])
            out["input_ids"].append(ex["input_ids"] + [self.pad_id] * pad)
            out["labels"].append(ex["labels"] + [IGNORE_INDEX] * pad)
            out["attention_mask"].append(ex["attention_mask"] + [0] * pad)
        return {k: torch.tensor(v, dtype=torch.long) for k, v in out.items()}


def count_records(t) -> Scanned:
    """``task = "sft"`` at validate: every record of ``t.dataset`` checked (swiftslurm/tasks.py), and the images of
    records that name some (``images.ImageScan``: files, formats, placeholders, tokens against ``t.max_length``)."""
    from ...sizing.vision import token_rule
    from .images import ImageScan, Scanned

    images = ImageScan(t.max_length, t.image_min_pixels, t.image_max_pixels, token_rule(t.model))

    def checked() -> Iterator[tuple[str, Any]]:
        for path in t.dataset:
            for line, rec in read_records(path):
                checked_one = check_record(Path(path), line, rec)
                images.check(rec, path, line)
                images.refuse_for_text(t.model, path, line)
                yield checked_one

    return Scanned(count_checked(checked(), list(t.dataset)), images.facts())
