"""Raw text for continued pretraining (``train.task = "pt"``): ``{"text": str}`` records -> token ids, every
token a label.

Records come through ``records`` like SFT's (JSONL, JSON, parquet, arrow, a ``save_to_disk`` directory), so a
malformed one names its file and line (row index for columnar files). Other fields of a record are ignored.

A document is tokenized with the tokenizer's special tokens (BOS where it adds one) and ends with EOS, so the
model learns where a document ends. No chat template, no prompt: the labels are the input ids. A document
longer than ``max_length`` is cut into pieces of ``max_length`` tokens (the last one shorter), each a sample
of its own: nothing of the corpus is thrown away, and packing (``packing``) fills rows with whole pieces, so
attention never crosses from one document into another. A piece of one token has nothing to predict and is
left out; a document left with no piece (an empty text with a tokenizer that adds no BOS) counts as dropped.

``encode_many`` has ``tokens.encode_many``'s shape for the token cache (``cache``): one tokenizer call per
chunk of records; it returns the samples of every record in order, and None for a record that gave none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from .images import refuse_images
from .records import DataError, count_checked, read_records

KIND = "text"
DROPPED = "an empty text has no token to predict"
HINT = 'each record is {"text": "..."}: raw text for train.task = "pt" (other fields are ignored)'


def check_record(path: Path, where: str, rec: Any) -> str:
    """The record's text, or a DataError naming the file and line."""
    if not isinstance(rec, dict):
        raise DataError(f"{path}, {where}: a record must be a JSON object", type(rec).__name__, HINT)
    if "text" not in rec:
        raise DataError(f"{path}, {where}: no 'text' field", f"keys {sorted(rec)[:6]}", HINT)
    refuse_images(rec, path, where, "pt")
    if not isinstance(rec["text"], str):
        raise DataError(f"{path}, {where}: 'text' must be a string", f"{type(rec['text']).__name__}: {repr(rec['text'])[:60]}", HINT)
    return rec["text"]


def checked_records(paths: list[str]) -> Iterator[tuple[str, Any]]:
    """(KIND, text) of every record of every file, in file order; a malformed one raises DataError."""
    for path in paths:
        for where, rec in read_records(path):
            yield KIND, check_record(Path(path), where, rec)


def scan(paths: list[str]) -> int:
    """Every record checked, nothing tokenized (the scan of ``validate``): the record count; none is a DataError."""
    return count_checked(checked_records(paths), paths)


def no_example_error(paths: list[str], dropped: int) -> DataError:
    return DataError("no text to train on in the dataset", f"{len(paths)} file(s), {dropped} empty text(s)",
                     "check train.dataset: each record needs a non-empty 'text'")


def pieces(ids: list[int], max_length: int) -> list[dict[str, list[int]]]:
    """One document's ids cut into samples of at most ``max_length`` tokens, labels = ids; 1-token pieces left out."""
    out = []
    for start in range(0, len(ids), max_length):
        piece = ids[start:start + max_length]
        if len(piece) > 1:
            out.append({"input_ids": piece, "labels": list(piece), "attention_mask": [1] * len(piece)})
    return out


def encode_many(records: list[tuple[str, Any]], tokenizer, max_length: int) -> list[dict[str, list[int]] | None]:
    """The samples of every (KIND, text) record in order (one tokenizer call), None for a record without any."""
    if not records:
        return []
    eos = tokenizer.eos_token_id
    out: list[dict[str, list[int]] | None] = []
    for ids in tokenizer([text for _, text in records], add_special_tokens=True)["input_ids"]:
        ids = list(ids)
        if eos is not None and (not ids or ids[-1] != eos):  # a tokenizer that adds EOS itself gets no second one
            ids.append(eos)
        out += pieces(ids, max_length) or [None]
    return out


def count_records(t) -> int:
    """``task = "pt"`` at validate: every ``{"text"}`` record of ``t.dataset`` checked (swiftslurm/tasks.py)."""
    return scan(list(t.dataset))
