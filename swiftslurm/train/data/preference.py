"""Preference data for ``task = "dpo"``: ``{"prompt", "chosen", "rejected"}`` records, checked and loaded.

Two forms, as TRL's DPOTrainer takes them (one form per dataset):

- standard: three strings, ``{"prompt": "2+2=", "chosen": "4", "rejected": "5"}``;
- conversational: message lists, ``{"prompt": [{"role": "user", "content": ...}], "chosen": [{"role":
  "assistant", "content": ...}], "rejected": [...]}`` (rendered with the tokenizer's chat template).

Files are any format of ``records`` (JSONL, a JSON list, parquet, arrow, a save_to_disk dir).
``check_files`` reads every record and raises ``DataError`` naming the file and line (columnar formats: row
index) of the first malformed one; ``validate`` and the trainer both call it. Light: nothing here imports torch or datasets until ``load``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from ...sizing.vision import token_rule
from .images import IMAGE_PLACEHOLDER, ImageScan, Scanned, image_paths, refuse_images
from .records import of_one_form
from .tokens import ROLES, DataError, read_records

FIELDS = ("prompt", "chosen", "rejected")
FORMAT_HINT = ('each record is {"prompt": str, "chosen": str, "rejected": str}, or the same keys holding '
               'message lists [{"role", "content"}, ...] (chosen/rejected: the assistant turn)')


def _bad(path: Path, where: str, what: str, found: str = "") -> DataError:
    return DataError(f"{path}, {where}: {what}", found, FORMAT_HINT)


def _records(path: str | Path) -> Iterator[tuple[str, Any]]:
    """("line N" or "row index N", record) of a JSONL/JSON/parquet/arrow file or save_to_disk dir (``records``)."""
    yield from read_records(path)


def _form(path: Path, where: str, key: str, value: Any) -> str:
    """"text" or "messages" for one field, or a DataError."""
    if isinstance(value, str):
        if not value.strip():
            raise _bad(path, where, f"'{key}' is empty")
        return "text"
    if isinstance(value, list) and value:
        for m in value:
            if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
                raise _bad(path, where, f"each message of '{key}' needs 'role' ({', '.join(ROLES)}) and a string 'content'",
                           repr(m)[:80])
        return "messages"
    raise _bad(path, where, f"'{key}' must be a non-empty string or message list", repr(value)[:80])


def check_record(path: Path, where: str, rec: Any) -> str:
    """The record's form ("text" or "messages"), or a DataError naming what is wrong."""
    if not isinstance(rec, dict):
        raise _bad(path, where, "a record must be a JSON object", type(rec).__name__)
    missing = [k for k in FIELDS if k not in rec]
    if missing:
        raise _bad(path, where, f"missing {', '.join(repr(k) for k in missing)}", f"keys {sorted(rec)[:6]}")
    forms = {k: _form(path, where, k, rec[k]) for k in FIELDS}
    if len(set(forms.values())) != 1:
        raise _bad(path, where, "prompt, chosen and rejected must all be strings or all be message lists",
                   ", ".join(f"{k}: {v}" for k, v in forms.items()))
    if forms["chosen"] == "messages":
        for key in ("chosen", "rejected"):
            if any(m["role"] != "assistant" for m in rec[key]):
                raise _bad(path, where, f"'{key}' holds the answer being judged: assistant messages only",
                           repr([m["role"] for m in rec[key]]))
    elif rec["chosen"] == rec["rejected"]:
        raise _bad(path, where, "'chosen' and 'rejected' are identical: the pair teaches nothing", repr(rec["chosen"])[:80])
    if rec.get("images"):  # a vision-language pair: the list, the messages form, one <image> in the prompt per image
        image_paths(rec, path, where)
        for key in ("chosen", "rejected"):
            if forms[key] == "messages" and any(IMAGE_PLACEHOLDER in m["content"] for m in rec[key]):
                raise _bad(path, where, f"an {IMAGE_PLACEHOLDER} in '{key}': a pair's images belong to its prompt",
                           repr([m["content"][:40] for m in rec[key]])[:120])
    return forms["chosen"]


def check_files(paths: list[str]) -> tuple[int, str]:
    """(record count, form) of every file together; the first malformed record, or a second form, raises."""
    return _check_all(paths)[:2]


def _check_all(paths: list[str]) -> tuple[int, str, bool]:
    """``check_files``, and whether any record names images (one pass over the files)."""
    count, form, images = 0, "", False

    def check(path: Path, where: str, rec: Any) -> str:
        nonlocal images
        checked = check_record(path, where, rec)
        images = images or bool(rec.get("images"))
        return checked

    for checked in of_one_form(paths, check, str, FORMAT_HINT, "preference"):
        count, form = count + 1, checked  # one form throughout
    return count, form, images


def _rows(paths: list[str], digests: list[str], with_images: bool = False) -> Iterator[dict[str, Any]]:
    for path in paths:  # digests: only in the key of the cache (a changed file is a new dataset)
        for where, rec in _records(path):
            row = {k: rec[k] for k in FIELDS}
            if with_images:  # the resolved paths (strings): the pixels are read when a micro-batch is collated
                row["images"] = [str(p) for p in image_paths(rec, path, where)]
            yield row


def load(paths: list[str], cache_dir: str | Path):
    """A ``datasets.Dataset`` of the checked records (only prompt/chosen/rejected, and ``images`` when the dataset
    names some: each record's image paths, resolved), in file order, written as Arrow under ``cache_dir`` (shared by
    the ranks: TRL's tokenized copy and precomputed reference log-probs are cached next to it, keyed by its
    fingerprint, so a requeue reuses them)."""
    from datasets import Dataset

    from .cache import dataset_digest

    with_images = _check_all(paths)[2]
    digests = [dataset_digest(p, cache_dir) for p in paths]
    kwargs = {"paths": list(paths), "digests": digests, "with_images": with_images}
    return Dataset.from_generator(_rows, gen_kwargs=kwargs, cache_dir=str(cache_dir))


def count_records(t) -> Scanned:
    """``task = "dpo"``/``"rm"`` at validate: every prompt/chosen/rejected pair of ``t.dataset`` checked
    (swiftslurm/tasks.py), and the images of pairs that name some (``images.ImageScan``), for a task that takes them."""
    from ...tasks import TASKS

    scan = ImageScan(t.max_length, t.image_min_pixels, t.image_max_pixels, token_rule(t.model))

    def check(path: Path, where: str, rec: Any) -> str:
        form = check_record(path, where, rec)
        scan.check(rec, path, where)
        scan.refuse_for_text(t.model, path, where)
        if not TASKS[t.task].images:
            refuse_images(rec, path, where, t.task)
        return form

    count = sum(1 for _ in of_one_form(list(t.dataset), check, str, FORMAT_HINT, "preference"))
    facts = scan.facts()
    if facts is not None:
        from ..vision import image_pair_problem

        problem = image_pair_problem(t)
        if problem:
            raise DataError(problem, f"{facts.records:,} pair(s) with images in train.dataset", "drop those keys for this dataset")
    return Scanned(count, facts)
