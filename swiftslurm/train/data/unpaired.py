"""Unpaired preference data for ``task = "kto"``: ``{"prompt", "completion", "label"}`` records, checked and loaded.

One completion per record, judged on its own: ``label = true`` (desirable) or ``false`` (undesirable), the form
TRL's KTOTrainer takes. Two forms, as for DPO pairs (one form per dataset):

- standard: ``{"prompt": "2+2=", "completion": " 4", "label": true}``;
- conversational: ``{"prompt": [{"role": "user", "content": ...}], "completion": [{"role": "assistant", "content":
  ...}], "label": false}`` (rendered with the tokenizer's chat template).

``check_files`` reads every record and raises ``DataError`` naming the file and line (columnar formats: row index)
of the first malformed one; ``validate`` and the trainer both call it. Nothing here imports torch or datasets until ``load``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from .images import refuse_images
from .preference import _form
from .records import of_one_form
from .tokens import DataError, read_records

FIELDS = ("prompt", "completion", "label")
FORMAT_HINT = ('each record is {"prompt": str, "completion": str, "label": true or false} (true: a desirable '
               'completion), or prompt/completion holding message lists [{"role", "content"}, ...] (completion: the '
               'assistant turn)')


def _bad(path: Path, where: str, what: str, found: str = "") -> DataError:
    return DataError(f"{path}, {where}: {what}", found, FORMAT_HINT)


def check_record(path: Path, where: str, rec: Any) -> tuple[str, bool]:
    """(the record's form, "text" or "messages"; its label), or a DataError naming what is wrong."""
    if not isinstance(rec, dict):
        raise _bad(path, where, "a record must be a JSON object", type(rec).__name__)
    missing = [k for k in FIELDS if k not in rec]
    if missing:
        hint = " (a chosen/rejected pair is task = \"dpo\" or \"rm\" data)" if "chosen" in rec else ""
        raise _bad(path, where, f"missing {', '.join(repr(k) for k in missing)}{hint}", f"keys {sorted(rec)[:6]}")
    refuse_images(rec, path, where, "kto")
    if not isinstance(rec["label"], bool):
        raise _bad(path, where, "'label' must be true (desirable) or false (undesirable)", repr(rec["label"])[:80])
    try:
        forms = {k: _form(path, where, k, rec[k]) for k in ("prompt", "completion")}
    except DataError as exc:  # preference's message, with this format's hint
        raise DataError(exc.what, exc.found, FORMAT_HINT) from None
    if forms["prompt"] != forms["completion"]:
        raise _bad(path, where, "prompt and completion must both be strings or both be message lists",
                   ", ".join(f"{k}: {v}" for k, v in forms.items()))
    if forms["completion"] == "messages" and any(m["role"] != "assistant" for m in rec["completion"]):
        raise _bad(path, where, "'completion' holds the answer being judged: assistant messages only",
                   repr([m["role"] for m in rec["completion"]]))
    return forms["completion"], rec["label"]


def check_files(paths: list[str]) -> tuple[int, str, int]:
    """(record count, form, desirable count) of every file together; the first malformed record, or a second
    form, raises. Both labels must occur: KTO learns from the contrast of desirable and undesirable completions."""
    count, desirable, form = 0, 0, ""
    for checked, label in of_one_form(paths, check_record, lambda result: result[0], FORMAT_HINT, "KTO"):
        count, desirable, form = count + 1, desirable + label, checked  # one form throughout
    if desirable in (0, count):
        raise DataError(f"every KTO record has label = {str(desirable == count).lower()}", f"{count} record(s) in {len(paths)} file(s)",
                        "KTO needs desirable (true) and undesirable (false) completions; add some of the other label")
    return count, form, desirable


def _rows(paths: list[str], digests: list[str]) -> Iterator[dict[str, Any]]:
    for path in paths:  # digests: only in the key of the cache (a changed file is a new dataset)
        for _, rec in read_records(path):
            yield {k: rec[k] for k in FIELDS}


def load(paths: list[str], cache_dir: str | Path):
    """A ``datasets.Dataset`` of the checked records (only prompt/completion/label), in file order, written as Arrow
    under ``cache_dir`` (shared by the ranks; TRL's tokenized copy is cached next to it, so a requeue reuses it)."""
    from datasets import Dataset

    from .cache import dataset_digest

    check_files(paths)
    digests = [dataset_digest(p, cache_dir) for p in paths]
    return Dataset.from_generator(_rows, gen_kwargs={"paths": list(paths), "digests": digests}, cache_dir=str(cache_dir))


def count_records(t) -> int:
    """``task = "kto"`` at validate: every prompt/completion/label record of ``t.dataset`` checked (swiftslurm/tasks.py)."""
    return check_files(list(t.dataset))[0]
