"""Prompt data for ``task = "grpo"``: one prompt per record, plus the columns the reward functions read.

A record holds ``prompt`` (a string, or a message list ``[{"role", "content"}]`` rendered with the chat template)
or ``messages`` (a conversation; trailing assistant turns are dropped: the model writes its own). Every other key
is a column TRL passes to each reward function as a keyword argument (one list entry per completion), e.g.
``solution`` for the built-in ``accuracy``. Every record holds the same columns; one form per dataset.

``check_files`` reads every record and raises ``DataError`` naming the file and line (columnar formats: row index)
of the first malformed one; ``validate`` and the trainer both call it. Light: nothing here imports torch or
datasets until ``load``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from .images import refuse_images
from .tokens import ROLES, DataError, read_records

FORMAT_HINT = ('each record is {"prompt": str} or {"prompt": [{"role", "content"}, ...]} or {"messages": [...]}, '
               "plus the columns your reward functions read (the same in every record)")
# names TRL passes to a reward function itself: a dataset column of the same name would collide with them
RESERVED = ("prompts", "completions", "completion", "completion_ids", "trainer_state", "log_extra", "log_metric",
            "environments")


def _bad(path: Path, where: str, what: str, found: str = "") -> DataError:
    return DataError(f"{path}, {where}: {what}", found, FORMAT_HINT)


def _messages(path: Path, where: str, key: str, value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _bad(path, where, f"'{key}' must be a non-empty message list", repr(value)[:80])
    for m in value:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise _bad(path, where, f"each message of '{key}' needs 'role' ({', '.join(ROLES)}) and a string 'content'",
                       repr(m)[:80])
    return value


def prompt_of(path: Path, where: str, rec: Any) -> tuple[str, Any]:
    """("text" | "messages", the prompt) of one record, or a DataError naming what is wrong."""
    if not isinstance(rec, dict):
        raise _bad(path, where, "a record must be a JSON object", type(rec).__name__)
    if "prompt" in rec and "messages" in rec:
        raise _bad(path, where, "both 'prompt' and 'messages': one of them is the prompt", f"keys {sorted(rec)[:6]}")
    refuse_images(rec, path, where, "grpo")
    if "prompt" in rec:
        value = rec["prompt"]
        if isinstance(value, str):
            if not value.strip():
                raise _bad(path, where, "'prompt' is empty")
            return "text", value
        return "messages", _messages(path, where, "prompt", value)
    if "messages" in rec:
        turns = list(_messages(path, where, "messages", rec["messages"]))
        while turns and turns[-1]["role"] == "assistant":
            turns.pop()
        if not turns:
            raise _bad(path, where, "'messages' holds only assistant turns: nothing is left to prompt the model with")
        return "messages", turns
    raise _bad(path, where, "missing 'prompt' (or 'messages'): GRPO generates its own completions from a prompt",
               f"keys {sorted(rec)[:6]}")


def columns_of(rec: dict[str, Any]) -> tuple[str, ...]:
    """The columns a record passes to the reward functions (every key but the prompt's)."""
    return tuple(sorted(k for k in rec if k not in ("prompt", "messages")))


def check_files(paths: list[str], need: tuple[str, ...] = ()) -> tuple[int, str, tuple[str, ...]]:
    """(record count, form, columns) of every file together. The first malformed record, a second form, other
    columns than the first record's, or a missing ``need``ed column (``solution`` for ``accuracy``) raises."""
    count, first = 0, None  # (form, columns, path, where) of the first record
    for path in paths:
        for where, rec in read_records(path):
            form, _ = prompt_of(Path(path), where, rec)
            cols = columns_of(rec)
            if first is None:
                clash = [c for c in cols if c in RESERVED]
                if clash:
                    raise _bad(Path(path), where, f"column {clash[0]!r} has the name of an argument TRL itself passes to "
                               "the reward functions", f"reserved: {', '.join(RESERVED)}")
                missing = [c for c in need if c not in cols]
                if missing:
                    raise _bad(Path(path), where, f"missing the column {missing[0]!r}, which the built-in 'accuracy' "
                               "reward compares the completion with", f"keys {sorted(rec)[:6]}")
                first = (form, cols, path, where)
            elif form != first[0]:
                raise _bad(Path(path), where, f"this prompt is {form} but {first[2]}, {first[3]} is {first[0]}: "
                           "one dataset holds one form")
            elif cols != first[1]:
                raise _bad(Path(path), where, f"the columns {list(cols)} differ from {first[2]}, {first[3]}'s "
                           f"{list(first[1])}: the reward functions get every column for every completion")
            count += 1
    if first is None:
        raise DataError("no prompt record in the dataset", f"{len(paths)} file(s)", "check train.dataset")
    return count, first[0], first[1]


def _rows(paths: list[str], digests: list[str]) -> Iterator[dict[str, Any]]:
    for path in paths:  # digests: only in the key of the cache (a changed file is a new dataset)
        for where, rec in read_records(path):
            _, prompt = prompt_of(Path(path), where, rec)
            yield {"prompt": prompt, **{k: rec[k] for k in columns_of(rec)}}


def load(paths: list[str], cache_dir: str | Path, need: tuple[str, ...] = ()):
    """A ``datasets.Dataset`` of the checked prompts and their columns, in file order, written as Arrow under
    ``cache_dir`` (shared by the ranks, reused by a requeue)."""
    from datasets import Dataset

    from .cache import dataset_digest

    check_files(paths, need)
    digests = [dataset_digest(p, cache_dir) for p in paths]
    return Dataset.from_generator(_rows, gen_kwargs={"paths": list(paths), "digests": digests}, cache_dir=str(cache_dir))


def count_records(t) -> int:
    """``task = "grpo"`` at validate: every prompt record of ``t.dataset`` checked, with the ``solution`` column the
    built-in ``accuracy`` reward reads when it is among ``t.reward_funcs`` (swiftslurm/tasks.py)."""
    return check_files(list(t.dataset), ("solution",) if "accuracy" in t.reward_funcs else ())[0]
