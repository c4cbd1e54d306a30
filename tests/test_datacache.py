"""The tokenized-data cache: same tokens as the plain reader, no second tokenization, a new key when a
file, the tokenizer or max_length changes, parallel tokenization gives the same arrays."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from swiftslurm.train.data import cache as datacache
from swiftslurm.train.data.tokens import DataError, load_dataset
from swiftslurm.train.tinymodel import build_tokenizer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "data"
FILES = [str(EXAMPLES / "alpaca_demo.jsonl"), str(EXAMPLES / "messages_demo.jsonl")]


@pytest.fixture()
def tok():
    return build_tokenizer()


def test_cache_holds_what_the_reader_encodes_and_is_read_back_without_tokenizing(tmp_path, tok, monkeypatch):
    built = datacache.cached_dataset(FILES, tok, 128, tmp_path)
    assert built.tokenized_now
    plain = load_dataset(FILES, tok, 128)
    assert len(built) == len(plain) == 60 and [built[i] for i in range(60)] == plain.examples
    assert built.lengths().tolist() == plain.lengths()
    calls = []
    monkeypatch.setattr(datacache.data, "encode_many", lambda *a: calls.append(a))  # a second run must not encode
    again = datacache.cached_dataset(FILES, tok, 128, tmp_path)
    assert not again.tokenized_now and calls == [] and again.directory == built.directory
    assert [again[i] for i in range(60)] == plain.examples


def test_one_tokenizer_call_per_chunk_encodes_each_record_as_one_call_per_record_does(tok):
    """The cache tokenizes a chunk of records in one call per kind (alpaca: the tokenizer's special tokens; chat:
    the template's): kinds interleaved and records that truncation drops must come back in place, unchanged."""
    from swiftslurm.train.data import tokens as data

    records = [rec for path in FILES for _, rec in data.read_records(path)]
    kinds = [data.check_record(Path(FILES[0]), 1, r) for r in records]
    mixed = [k for pair in zip(kinds[:30], kinds[30:], strict=False) for k in pair]  # alpaca, chat, alpaca, chat, ...
    for max_length in (24, 40, 128):
        one_by_one = [data.encode(kind, rec, tok, max_length) for kind, rec in mixed]
        assert data.encode_many(mixed, tok, max_length) == one_by_one
    assert None in [data.encode(kind, rec, tok, 24) for kind, rec in mixed]  # some were dropped at 24 tokens
    calls = []
    real = tok.__call__
    tok_calls = type("Counting", (), {"__call__": lambda self, *a, **k: calls.append(1) or real(*a, **k),
                                      "__getattr__": lambda self, name: getattr(tok, name)})()
    data.encode_many(mixed, tok_calls, 128)
    assert len(calls) == 2  # one per kind, not one per record


def test_a_changed_file_tokenizer_or_max_length_is_a_new_cache(tmp_path, tok):
    data = tmp_path / "d.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    root = tmp_path / "cache"
    key = datacache.cache_key([str(data)], tok, 64)
    assert datacache.cache_key([str(data)], tok, 64) == key
    assert datacache.cache_key([str(data)], tok, 65) != key
    other = build_tokenizer()
    other.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    assert datacache.cache_key([str(data)], other, 64) != key
    first = datacache.cached_dataset([str(data)], tok, 64, root)
    time.sleep(0.01)
    data.write_text('{"instruction": "a", "output": "c"}\n')  # same size, same name, new content
    second = datacache.cached_dataset([str(data)], tok, 64, root)
    assert second.tokenized_now and second.directory != first.directory
    assert tok.decode(second[0]["input_ids"]).endswith("c</s>")


def test_parallel_tokenization_gives_the_same_cache(tmp_path, tok):
    one = datacache.cached_dataset(FILES, tok, 128, tmp_path / "a", num_proc=1)
    two = datacache.cached_dataset(FILES, tok, 128, tmp_path / "b", num_proc=2)
    assert (one.directory / "input_ids.bin").read_bytes() == (two.directory / "input_ids.bin").read_bytes()
    assert (one.directory / "labels.bin").read_bytes() == (two.directory / "labels.bin").read_bytes()


def test_malformed_record_still_names_file_and_line_and_leaves_no_cache(tmp_path, tok):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": 3}\n')
    with pytest.raises(DataError) as info:
        datacache.cached_dataset([str(bad)], tok, 64, tmp_path / "cache")
    assert f"{bad}, line 2" in info.value.what
    assert not list((tmp_path / "cache").iterdir())


def test_a_datasets_digest_is_hashed_once_and_read_back_while_its_files_are_unchanged(tmp_path, monkeypatch):
    """Rank 0 hashes the dataset (every caller runs it first); the other ranks, requeues and restarts read the digest
    back from the output dir's cache while the file's name, inode, size, mtime and ctime are what was hashed."""
    import json
    import os

    data = tmp_path / "d.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    caches = tmp_path / "out" / ".swiftslurm-cache"
    hashed = []
    real = datacache._hash_files
    monkeypatch.setattr(datacache, "_hash_files", lambda path, files: hashed.append(path) or real(path, files))
    first = datacache.dataset_digest(str(data), caches / "tokenized")
    assert datacache.dataset_digest(str(data), caches / "split") == first and hashed == [str(data)]  # one memo for every cache
    (memo,) = (caches / "digests").iterdir()
    assert json.loads(memo.read_text())["digest"] == first
    assert datacache.dataset_digest(str(data)) == first and len(hashed) == 2  # without a cache dir: hashed each time

    before = data.stat()
    time.sleep(0.05)  # file times move in kernel ticks (1-10 ms): the rewrite must land in a later one
    data.write_text('{"instruction": "a", "output": "c"}\n')  # same size, new bytes,
    os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))  # and the mtime put back: the ctime still moved
    assert (data.stat().st_size, data.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    second = datacache.dataset_digest(str(data), caches / "tokenized")
    assert second != first and len(hashed) == 3
    memo.write_text("{not json")  # damaged, or not ours: hashed again, never trusted
    assert datacache.dataset_digest(str(data), caches / "tokenized") == second and len(hashed) == 4
