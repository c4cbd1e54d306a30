"""Records out of dataset files, one at a time, each with where it came from (for error messages).

This layer knows file formats, not what a record means: SFT (``data``) and preference data read
through it and check the records themselves. ``read_records(path)`` yields ``(where, record)``, where
``where`` is ``"line N"`` (JSON formats, 1-based) or ``"row index N"`` (columnar formats, 0-based as
``dataset[N]``), so an error reads ``<file>, line 12: ...``.

Formats, by name:

- ``*.jsonl`` / ``*.ndjson`` (and a ``*.json`` that does not start with ``[``): one JSON object per line.
- ``*.json`` holding an array of records.
- ``*.parquet``: read in row batches.
- ``*.arrow``: an Arrow IPC file or stream (what ``datasets`` writes).
- a directory written by ``datasets.Dataset.save_to_disk`` (its ``state.json`` lists the arrow
  shards, read in order). A ``DatasetDict`` directory is refused with its splits named: give the
  split's directory (``data/train``).

One reading is not of the file format but of every conversational record, here so that every reader sees it: a
message whose ``content`` is a list of parts (TRL's and the hub datasets' vision form) is read as the text form,
its text parts joined and each ``{"type": "image"}`` part an ``<image>`` placeholder, in order (``text_content``).

Memory: nothing holds the whole dataset. JSONL is read line by line; parquet and arrow batch by
batch (arrow files are memory-mapped); a JSON array is parsed element by element from the file's text
(so that one format holds the file's text, not its records). A null in a columnar file is an absent
field (a columnar schema gives every row every column).

Why pyarrow and not ``datasets.load_dataset``: ``datasets`` converts every input into its own arrow
cache first (a second copy of the data in ``~/.cache/huggingface``, on every node that reads it), its
JSON loader infers one schema for all records (a file mixing alpaca and messages records fails) and
its errors do not say which line is wrong. pyarrow (which ``datasets`` is built on, and which it brings
along) reads parquet and arrow directly, in batches, with row indices; the ``save_to_disk`` layout is
two documented files. Importing pyarrow also costs a quarter of ``datasets``' second, which
``swiftslurm validate`` pays on every call.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, Callable, Generator, Iterable, Iterator

from ...errors import SwiftSlurmError
from ...fsutil import CONFIG_CAP, LINE_CAP, MAX_DEPTH, json_depth, open_regular, read_json

IMAGE_PLACEHOLDER = "<image>"  # an image's place in a message's text (images.py holds the rest of the contract)
CONVERSATION_KEYS = ("messages", "prompt", "chosen", "rejected", "completion")  # where a record holds messages
JSON_LINES = (".jsonl", ".ndjson")
FORMATS = "JSONL (.jsonl), JSON (.json), parquet (.parquet), arrow (.arrow) or a datasets.save_to_disk directory"
BATCH_ROWS = 1024
JSON_BLOCK = 1 << 20


class DataError(SwiftSlurmError):
    """A dataset file that cannot be read or a record that does not fit the training format."""

    exit_code = 2


def not_found(path: str | Path) -> DataError:
    return DataError("dataset file not found", str(path), "check train.dataset; paths are relative to where you submit")


def bad_json(path: Path, where: str, msg: str, found: str = "") -> DataError:
    return DataError(f"{path}, {where}: not valid JSON: {msg}", found,
                     "JSONL holds one JSON object per line; a .json file holds one JSON array of objects")


def read_records(path: str | Path) -> Iterator[tuple[str, Any]]:
    """(where, record) for every record of one dataset file or ``save_to_disk`` directory, in order; messages with
    content parts read as text (``text_content``)."""
    for where, rec in _file_records(path):
        yield where, text_content(rec, path, where)


def text_content(rec: Any, path: str | Path, where: str) -> Any:
    """``rec`` with every message of its conversations (``CONVERSATION_KEYS``) whose content is a list of parts
    written as the text form: ``[{"type": "image"}, {"type": "text", "text": "What is it?"}]`` -> ``"<image>What is
    it?"`` (chat templates join the parts the same way). A part may carry its other keys as null (a columnar file
    gives every part every key) and an image part its ``index`` in the record's ``images``, in order. A part of
    another type, or an image part holding its image inline, is a DataError naming the record. ``rec`` as it is when
    nothing is a list of parts."""
    if not isinstance(rec, dict) or not any(_has_parts(rec.get(key)) for key in CONVERSATION_KEYS):
        return rec
    images = [0]  # image parts seen, over the record's messages in order
    return {**rec, **{key: [_text_message(m, path, where, images) for m in rec[key]]
                      for key in CONVERSATION_KEYS if _has_parts(rec.get(key))}}


def _has_parts(messages: Any) -> bool:
    return isinstance(messages, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages)


def _text_message(message: Any, path: str | Path, where: str, images: list[int]) -> Any:
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    return {**message, "content": "".join(_part_text(part, path, where, images) for part in message["content"])}


def _part_text(part: Any, path: str | Path, where: str, images: list[int]) -> str:
    hint = ('content parts are {"type": "text", "text": "..."} and {"type": "image"} (the image\'s path in the '
            'record\'s "images", in order); or write content as a string with one <image> an image')
    kind = part.get("type") if isinstance(part, dict) else None
    extra = sorted(k for k, v in part.items() if v is not None and k not in ("type", "text", "index")) if isinstance(part, dict) else []
    if kind == "text" and isinstance(part.get("text"), str) and not extra:
        return part["text"]
    if kind == "image" and part.get("text") is None and not extra:
        index = part.get("index")
        if index is not None and index != images[0]:
            raise DataError(f"{path}, {where}: image part {images[0] + 1} says index {index!r}", repr(part)[:120],
                            "image parts take the record's images in order: drop index, or put the images in that order")
        images[0] += 1
        return IMAGE_PLACEHOLDER
    what = (f"an image part holding its image ({', '.join(extra)})" if kind == "image" else
            f"a content part of type {kind!r}" if isinstance(part, dict) else "a content part that is not an object")
    raise DataError(f"{path}, {where}: {what} is not taken", repr(part)[:120], hint)


def _file_records(path: str | Path) -> Iterator[tuple[str, Any]]:
    p = Path(path)
    if p.is_dir():  # row indices run on over the shards, as in the loaded dataset: p, row index N = dataset[N]
        start = 0
        for shard in dataset_dir_files(p):
            start = yield from _arrow_rows(shard, start)
        return
    if not p.exists():
        raise not_found(p)
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        yield from _parquet_rows(p)
    elif suffix == ".arrow":
        yield from _arrow_rows(p)
    elif suffix == ".json" and _starts_with_bracket(p):
        yield from _json_array(p)
    elif suffix == ".json" or suffix in JSON_LINES:
        yield from _json_lines(p)
    else:
        raise DataError("unknown dataset format", f"{p} (suffix {suffix or 'none'!r})",
                        f"train.dataset takes {FORMATS}; rename the file to its format's suffix")


def count_checked(checked: Iterable[Any], paths: list[str]) -> int:
    """How many records a scan of ``validate`` checked (``checked``: one item a record, each raising on a bad one);
    a dataset without any record is a DataError too (training it would fail)."""
    count = sum(1 for _ in checked)
    if not count:
        raise DataError("the dataset holds no record", f"{len(paths)} file(s): {', '.join(paths)}"[:300],
                        "check train.dataset: every file or directory there is empty")
    return count


def of_one_form(paths: list[str], check: Callable[[Path, str, Any], Any], form_of: Callable[[Any], str], hint: str,
                kind: str) -> Iterator[Any]:
    """``check(path, where, record)`` of every record of every file, in order, each result yielded; a dataset holds
    one form (plain text or messages): a record whose ``form_of(result)`` differs from the first record's raises
    naming both places (``hint``: the format's), and a dataset without a record raises ("no ``kind`` record")."""
    first = None  # (form, path, where) of the first record
    for path in paths:
        for where, rec in read_records(path):
            result = check(Path(path), where, rec)
            form = form_of(result)
            if first is None:
                first = (form, path, where)
            elif form != first[0]:
                raise DataError(f"{path}, {where}: this record is {form} but {first[1]}, {first[2]} is {first[0]}: "
                                "one dataset holds one form", "", hint)
            yield result
    if first is None:
        raise DataError(f"no {kind} record in the dataset", f"{len(paths)} file(s)", "check train.dataset")


def dataset_dir_files(directory: Path) -> list[Path]:
    """The arrow shards of a ``save_to_disk`` directory, in order (its ``state.json``)."""
    state = directory / "state.json"
    if not state.is_file():
        splits = _splits(directory)
        if splits:
            raise DataError("a DatasetDict directory holds several splits; name one", f"{directory}: splits {splits}",
                            f"set train.dataset to one split's directory, e.g. {directory / splits[0]}")
        raise DataError("not a dataset directory (no state.json)", str(directory),
                        f"a directory must be written by datasets' save_to_disk; train.dataset also takes {FORMATS}")
    try:
        names = [f["filename"] for f in read_json(state, CONFIG_CAP)["_data_files"]]
        if not all(isinstance(n, str) and n and (directory / n).resolve().parent == directory.resolve() for n in names):
            raise ValueError("a shard name that is not a file of this directory")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError("cannot read the dataset directory's state.json", f"{state}: {exc!r}"[:200],
                        "write the directory again with datasets' save_to_disk") from None
    files = [directory / name for name in names]
    for f in files:
        if not f.is_file():
            raise DataError("a shard listed in state.json is missing", str(f), "copy the whole save_to_disk directory")
    return files


def _splits(directory: Path) -> list[str]:
    try:
        return [str(s) for s in read_json(directory / "dataset_dict.json", CONFIG_CAP)["splits"]][:100]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def content_files(path: str | Path) -> list[Path]:
    """The files whose bytes are the dataset (for cache keys): the file itself, or a directory's state and shards."""
    p = Path(path)
    if p.is_dir():
        return [p / "state.json", *dataset_dir_files(p)]
    return [p]


def _unreadable(p: Path, exc: Exception | str) -> DataError:
    return DataError("cannot read the dataset file", f"{p}: {exc}", f"train.dataset takes {FORMATS}, JSON as UTF-8")


def _open(p: Path) -> io.BufferedReader:
    """A dataset file, a regular one only (a FIFO or device in its place would block or never end)."""
    try:
        return io.BufferedReader(open_regular(p), 1 << 20)
    except OSError as exc:
        raise _unreadable(p, exc.strerror or exc) from None


def _record(p: Path, where: str, text: str | bytes, decode: Any) -> Any:
    """One record decoded, refused past MAX_DEPTH levels of nesting (deeper JSON is an attack, not a record)."""
    try:
        value = decode(text)
    except RecursionError:
        value = None
        deep = True
    else:
        deep = json_depth(value[0] if isinstance(value, tuple) else value, MAX_DEPTH) > MAX_DEPTH
    if deep:
        raise bad_json(p, where, f"nested deeper than {MAX_DEPTH} levels")
    return value


def _json_lines(p: Path) -> Iterator[tuple[str, Any]]:
    fh = _open(p)
    with fh:
        lineno = 0
        while True:
            try:
                raw = fh.readline(LINE_CAP + 1)
            except OSError as exc:
                raise _unreadable(p, exc) from None
            if not raw:
                return
            lineno += 1
            if len(raw) > LINE_CAP and not raw.endswith(b"\n"):
                raise bad_json(p, f"line {lineno}", f"a line longer than {LINE_CAP >> 20} MiB", raw[:80].decode("utf-8", "replace"))
            if not raw.strip():
                continue
            try:
                yield f"line {lineno}", _record(p, f"line {lineno}", raw, json.loads)
            except UnicodeDecodeError as exc:
                raise _unreadable(p, f"line {lineno}: {exc}") from None
            except json.JSONDecodeError as exc:
                raise bad_json(p, f"line {lineno}", exc.msg, raw[:80].decode("utf-8", "replace").rstrip()) from None


def _starts_with_bracket(p: Path) -> bool:
    with _open(p) as fh:
        try:
            return fh.read(JSON_BLOCK).removeprefix(b"\xef\xbb\xbf").lstrip().startswith(b"[")
        except OSError as exc:
            raise _unreadable(p, exc) from None


def _json_array(p: Path) -> Iterator[tuple[str, Any]]:
    """Element by element: raw_decode at each position, tracking the line each element starts on."""
    try:
        with _open(p) as fh:
            text = fh.read().decode("utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise _unreadable(p, exc) from None
    decoder = json.JSONDecoder()
    pos, line, counted = text.index("[") + 1, 1, 0

    def skip() -> str:  # past whitespace; the next character ("" at the end)
        nonlocal pos, line, counted
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        line += text.count("\n", counted, pos)
        counted = pos
        return text[pos:pos + 1]

    if skip() != "]":
        while True:
            try:
                record, pos = _record(p, f"line {line}", text, lambda t, pos=pos: decoder.raw_decode(t, pos))
            except json.JSONDecodeError as exc:
                raise bad_json(p, f"line {exc.lineno}", exc.msg, text[exc.pos:exc.pos + 60].split("\n")[0]) from None
            yield f"line {line}", record
            nxt = skip()
            if nxt == "]":
                break
            if nxt != ",":
                raise bad_json(p, f"line {line}", "expected ',' or ']' after a record" if nxt else "the array is not closed",
                               text[pos:pos + 40])
            pos += 1
            skip()
    pos += 1
    if skip():
        raise bad_json(p, f"line {line}", "extra data after the array", text[pos:pos + 40])


def _clean(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if v is not None}


def _batches_rows(p: Path, batches, what: str, index: int = 0) -> Generator[tuple[str, Any], None, int]:
    """The rows of record batches from row index ``index`` on; returns the index after the last."""
    from pyarrow import ArrowException

    try:
        for batch in batches:
            for row in batch.to_pylist():
                yield f"row index {index}", _clean(row)
                index += 1
    except (OSError, ValueError, ArrowException) as exc:  # a truncated file, a type pyarrow cannot convert
        raise DataError(f"cannot read the {what} file", f"{p}, after row index {index}: {exc}"[:300],
                        "the file may be truncated or not in this format; write it again") from None
    return index


def _pyarrow(p: Path):
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise DataError("reading parquet and arrow datasets needs pyarrow, which is not installed", str(p),
                        "pip install 'swiftslurm[train]' (or pyarrow), or convert the data to JSONL") from None
    return pyarrow


def _parquet_rows(p: Path) -> Iterator[tuple[str, Any]]:
    pq = _pyarrow(p).parquet
    try:
        reader = pq.ParquetFile(p)
    except (OSError, ValueError) as exc:
        raise DataError("cannot read the parquet file", f"{p}: {exc}"[:300], "write it again (e.g. Dataset.to_parquet)") from None
    yield from _batches_rows(p, reader.iter_batches(batch_size=BATCH_ROWS), "parquet")


def _arrow_rows(p: Path, start: int = 0) -> Generator[tuple[str, Any], None, int]:
    pa = _pyarrow(p)
    try:
        source = pa.memory_map(str(p))
        try:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except (OSError, ValueError):
            source.seek(0)
            batches = pa.ipc.open_stream(source)
    except (OSError, ValueError) as exc:
        raise DataError("cannot read the arrow file", f"{p}: {exc}"[:300],
                        "an Arrow IPC file or stream, as datasets' save_to_disk writes it") from None
    return (yield from _batches_rows(p, batches, "arrow", start))
