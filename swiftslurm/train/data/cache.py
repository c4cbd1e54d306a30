"""Tokenize once: the encoded dataset as flat arrays on disk, memory-mapped by every rank.

``cached_dataset(paths, tokenizer, max_length, cache_root, num_proc, task)`` returns a ``CachedDataset``
(map-style, same items as ``data.SFTDataset``). ``task`` picks how records are checked and encoded (``codec``):
SFT's records with the prompt masked (``tokens``), or raw text with every token a label (``text``, task "pt").
The cache directory is named by a key over
everything that changes the tokens: each file's content (sha256, not its mtime; for a ``save_to_disk``
directory its ``state.json`` and every arrow shard), the tokenizer
(its serialized vocabulary/rules, special tokens and chat template), ``max_length``, the prompt
templates of ``data`` and the task (the same file is other tokens as raw text than as SFT records). A
requeue, or a second run on the same data, finds the directory and tokenizes nothing; a changed file, tokenizer or ``max_length`` is a new key.

Layout of ``<cache_root>/<key>/``: ``input_ids.bin`` and ``labels.bin`` (int32, every example back to
back), ``offsets.bin`` (int64, n + 1), ``meta.json`` (written last: a directory without it is not a
cache, and the directory is built under a temporary name and renamed into place, so a reader never
sees half of one). This is the small part of an arrow cache we need: three flat arrays, no schema.

Memory: the builder streams records (``records``), encodes a bounded window of chunks and writes each
example's tokens and its end offset as it goes, so it holds a few chunks, never the dataset. A reader
holds three memory maps: what it touches is page cache, shared by every rank of the node.

Records are checked in this process, in file order (a malformed record names its file and line);
with ``num_proc > 1`` the encoding runs in that many worker processes, chunk by chunk, in order.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import tempfile
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from itertools import islice
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Iterator

from ...fsutil import RECORD_CAP, atomic_write_text, open_regular, read_json
from ...tasks import TASKS
from . import tokens as data
from .records import content_files, not_found

FORMAT = 2
CHUNK = 2048  # records per work unit
WINDOW = 4  # chunks in flight per worker process


DIGESTS = "digests"  # beside the caches' own dirs (<output>/.swiftslurm-cache/<kind>): one memo for all of them


def _signature(files: list[Path]) -> list[list[Any]] | None:
    """What changes when a file's bytes may have: name, inode, size, mtime and ctime (ns; ctime no user can set back);
    None when one is missing. Not the device: a file server's mount has another on every node."""
    try:
        return [[f.name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns] for f in files for st in (os.stat(f),)]
    except OSError:
        return None


def dataset_digest(path: str, cache_root: str | Path | None = None) -> str:
    """sha256 over a dataset's files (one file, or a save_to_disk directory's state and shards). With ``cache_root``
    (a cache dir of the output dir) the digest is remembered beside it under ``digests/``, by the files' signature:
    every caller runs rank 0 first (``main_process_first``), so rank 0 hashes the dataset once and every other rank,
    requeue and restart reads the digest back while the files are unchanged."""
    files = content_files(path)
    memo = Path(cache_root).parent / DIGESTS / f"{hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:24]}.json" if cache_root else None
    signature = _signature(files)
    if memo is not None and signature is not None:
        try:
            known = read_json(memo, RECORD_CAP)
            if known.get("signature") == signature and isinstance(known.get("digest"), str):
                return known["digest"]
        except (OSError, ValueError):  # none yet, or not one of ours: hash
            pass
    digest = _hash_files(path, files)
    if memo is not None and signature is not None and _signature(files) == signature:  # unchanged while it was read
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(memo, json.dumps({"path": os.path.abspath(path), "signature": signature, "digest": digest}))
        except OSError:
            pass  # the next rank hashes too: slower, never wrong
    return digest


def _hash_files(path: str, files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        try:
            with open_regular(f) as fh:  # never a FIFO or a device under a dataset's name
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
        except FileNotFoundError:
            raise not_found(f) from None
        h.update(f"\0{f.name}\0".encode())
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """A digest of what decides the tokens: vocabulary and rules, special tokens, chat template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    h.update(body.encode())
    extra = [type(tokenizer).__name__, tokenizer.chat_template, tokenizer.bos_token, tokenizer.eos_token,
             list(tokenizer.all_special_tokens)]
    h.update(json.dumps(extra, default=str).encode())
    return h.hexdigest()


def codec(task: str):
    """The module that checks and encodes the records of ``task``, a task that tokenizes through this cache (SFT's
    ``tokens``, raw text's ``text`` for "pt"): the data module its row names (``swiftslurm/tasks.py``). Each has
    ``checked_records``, ``encode_many``, ``no_example_error`` and ``DROPPED`` (why a record gave nothing)."""
    return importlib.import_module(f".{TASKS[task].data}", __package__)


def cache_key(paths: list[str], tokenizer, max_length: int, task: str = "sft", cache_root: str | Path | None = None) -> str:
    h = hashlib.sha256()
    body = {"format": FORMAT, "max_length": max_length, "tokenizer": tokenizer_fingerprint(tokenizer),
            "templates": [data.ALPACA_PROMPT, data.ALPACA_PROMPT_INPUT], "files": [dataset_digest(p, cache_root) for p in paths]}
    if task != "sft":  # SFT's key stays what it was, so caches written before tasks had keys are still found
        body["task"] = task
    h.update(json.dumps(body).encode())
    return h.hexdigest()[:24]


class CachedDataset:
    """Encoded examples read from the cache's memory-mapped arrays (no per-example Python objects held)."""

    def __init__(self, directory: Path) -> None:
        import numpy as np

        self.directory = directory
        self.meta = read_json(directory / "meta.json", RECORD_CAP)
        self.offsets = np.memmap(directory / "offsets.bin", dtype=np.int64, mode="r")
        count = int(self.offsets[-1])
        self.input_ids = np.memmap(directory / "input_ids.bin", dtype=np.int32, mode="r", shape=(count,)) if count else np.zeros(0, np.int32)
        self.labels = np.memmap(directory / "labels.bin", dtype=np.int32, mode="r", shape=(count,)) if count else np.zeros(0, np.int32)
        self.dropped = int(self.meta["dropped"])
        self.tokenized_now = False  # set by cached_dataset when this process built it

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        ids = self.input_ids[lo:hi].tolist()
        return {"input_ids": ids, "labels": self.labels[lo:hi].tolist(), "attention_mask": [1] * len(ids)}

    def lengths(self):
        """Tokens per example: a numpy int64 array (8 bytes per example, not a Python list)."""
        import numpy as np

        return np.diff(self.offsets)


_worker_tokenizer = None
_worker_max_length = 0
_worker_task = "sft"


def _init_worker(tokenizer, max_length: int, task: str = "sft") -> None:
    global _worker_tokenizer, _worker_max_length, _worker_task
    _worker_tokenizer, _worker_max_length, _worker_task = tokenizer, max_length, task


def _encode_chunk(records: list[tuple[str, Any]]) -> list[dict[str, list[int]] | None]:
    return codec(_worker_task).encode_many(records, _worker_tokenizer, _worker_max_length)  # one tokenizer call per chunk


def _chunks(records: Iterator[tuple[str, Any]]) -> Iterator[list[tuple[str, Any]]]:
    while chunk := list(islice(records, CHUNK)):
        yield chunk


def _encoded_chunks(paths: list[str], tokenizer, max_length: int, num_proc: int, task: str = "sft"):
    chunks = _chunks(codec(task).checked_records(paths))
    if num_proc <= 1:
        _init_worker(tokenizer, max_length, task)
        yield from map(_encode_chunk, chunks)
        return
    # spawn, not fork: this process may already hold torch threads and a process group. Not pool.map:
    # it submits every chunk at once, which holds the whole dataset in this process.
    with ProcessPoolExecutor(num_proc, mp_context=get_context("spawn"), initializer=_init_worker,
                             initargs=(tokenizer, max_length, task)) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.submit(_encode_chunk, chunk))
            if len(pending) >= WINDOW * num_proc:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _build(directory: Path, paths: list[str], tokenizer, max_length: int, num_proc: int, task: str = "sft") -> None:
    import numpy as np

    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        examples, tokens, dropped = 0, 0, 0
        names = ("input_ids.bin", "labels.bin", "offsets.bin")
        with ExitStack() as stack:
            ids_fh, labels_fh, offsets_fh = (stack.enter_context(open(tmp / name, "wb")) for name in names)
            offsets_fh.write(np.zeros(1, np.int64).tobytes())
            for encoded in _encoded_chunks(paths, tokenizer, max_length, num_proc, task):
                ends = []
                for ex in encoded:
                    if ex is None:
                        dropped += 1
                        continue
                    ids_fh.write(np.asarray(ex["input_ids"], dtype=np.int32).tobytes())
                    labels_fh.write(np.asarray(ex["labels"], dtype=np.int32).tobytes())
                    tokens += len(ex["input_ids"])
                    ends.append(tokens)
                offsets_fh.write(np.asarray(ends, dtype=np.int64).tobytes())
                examples += len(ends)
            for fh in (ids_fh, labels_fh, offsets_fh):
                fh.flush()
                os.fsync(fh.fileno())
        if not examples:
            raise codec(task).no_example_error(paths, dropped)
        (tmp / "meta.json").write_text(json.dumps({"format": FORMAT, "examples": examples, "dropped": dropped,
                                                   "tokens": tokens, "files": paths, "max_length": max_length,
                                                   "task": task}))
        try:
            os.rename(tmp, directory)
        except OSError:  # another process renamed its copy first: keep that one
            if not (directory / "meta.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cached_dataset(paths: list[str], tokenizer, max_length: int, cache_root: str | Path,
                   num_proc: int = 1, task: str = "sft") -> CachedDataset:
    """The encoded dataset from ``cache_root/<key>``, tokenizing (and caching) it first when absent."""
    if task == "sft":  # raw text ("pt") is tokenized without a chat template
        data.ensure_chat_template(tokenizer)
    directory = Path(cache_root) / cache_key(paths, tokenizer, max_length, task, cache_root)
    built = False
    if not (directory / "meta.json").exists():
        _build(directory, paths, tokenizer, max_length, num_proc, task)
        built = True
    dataset = CachedDataset(directory)
    dataset.tokenized_now = built
    return dataset
