"""Dataset formats: JSON arrays, parquet, arrow and save_to_disk directories give the tokens of the same
records in JSONL; files mix in order; a malformed record is named (file and line, or row index) by
`swiftslurm validate`; the cache covers every file of a directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from swiftslurm.checkpoint.fingerprint import dataset_identity
from swiftslurm.train.data import cache as datacache
from swiftslurm.train.data.records import read_records
from swiftslurm.train.data.tokens import DataError, load_dataset
from swiftslurm.train.tinymodel import build_tokenizer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "data"
# alpaca with and without input, and conversations, in one file: a columnar schema holds all their columns
RECORDS = [json.loads(line) for name in ("alpaca_demo.jsonl", "messages_demo.jsonl")
           for line in (EXAMPLES / name).read_text().splitlines()[:12]]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _save_to_disk(path: Path, records) -> Path:
    import datasets  # the train extra
    datasets.Dataset(datasets.table.InMemoryTable(_table(records))).save_to_disk(str(path), num_shards=min(3, len(records)))  # several shards
    return path


def _table(records) -> pa.Table:
    return pa.Table.from_struct_array(pa.array(records))  # the columns of every record (from_pylist: the first's)


def _arrow_file(path: Path, records) -> Path:
    table = _table(records)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=5)
    return path


WRITERS = {
    "json": lambda d, r: (d / "d.json").write_text(json.dumps(r, indent=2)) and d / "d.json",
    "parquet": lambda d, r: pq.write_table(_table(r), d / "d.parquet", row_group_size=7) or d / "d.parquet",
    "arrow-file": lambda d, r: _arrow_file(d / "d.arrow", r),
    "save_to_disk": lambda d, r: _save_to_disk(d / "saved", r),
}


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_each_format_gives_the_tokens_of_jsonl(tmp_path, tok, fmt):
    path = WRITERS[fmt](tmp_path, RECORDS)
    if fmt == "save_to_disk":
        assert len(list(path.glob("*.arrow"))) > 1  # row indices run on over the shards: dataset[i]
        assert [where for where, _ in read_records(path)] == [f"row index {i}" for i in range(len(RECORDS))]
    expected = load_dataset([str(_jsonl(tmp_path / "d.jsonl", RECORDS))], tok, 128).examples
    assert load_dataset([str(path)], tok, 128).examples == expected and len(expected) == len(RECORDS)


def test_mixed_files_are_read_in_order(tmp_path, tok):
    a, b, c = RECORDS[:5], RECORDS[5:14], RECORDS[14:]
    files = [_jsonl(tmp_path / "a.jsonl", a), WRITERS["parquet"](tmp_path, b), _save_to_disk(tmp_path / "c", c)]
    mixed = load_dataset([str(f) for f in files], tok, 128).examples
    assert mixed == load_dataset([str(_jsonl(tmp_path / "all.jsonl", RECORDS))], tok, 128).examples
    cached = datacache.cached_dataset([str(f) for f in files], tok, 128, tmp_path / "cache")
    assert [cached[i] for i in range(len(cached))] == mixed


def test_a_json_array_names_the_line_a_record_starts_on(tmp_path, tok):
    f = tmp_path / "d.json"
    f.write_text('[\n  {"instruction": "a", "output": "b"},\n\n  {"instruction": "a",\n   "output": 3}\n]\n')
    assert [where for where, _ in read_records(f)] == ["line 2", "line 4"]
    with pytest.raises(DataError, match=rf"{f}, line 4: alpaca field 'output'"):
        load_dataset([str(f)], tok, 64)
    for text, line in (('[{"instruction": "a", "output": "b"}\n{"x": 1}]', 2), ('[{"instruction": "a", "output": "b"},\n]', 2),
                       ('[{"instruction": "a", "output": "b"}', 1), ("[]\n[]", 2)):
        f.write_text(text)
        with pytest.raises(DataError, match=rf"line {line}: not valid JSON"):
            list(read_records(f))
    f.write_text("[]")
    assert list(read_records(f)) == []
    f.write_bytes(b'\xef\xbb\xbf \n[{"instruction": "a", "output": "b"}]')  # a BOM, then whitespace
    assert list(read_records(f)) == [("line 2", {"instruction": "a", "output": "b"})]


def test_unknown_formats_and_a_dataset_dict_are_refused_with_what_to_do(tmp_path):
    (tmp_path / "d.csv").write_text("instruction,output\n")
    with pytest.raises(DataError, match="unknown dataset format") as info:
        list(read_records(tmp_path / "d.csv"))
    assert ".parquet" in info.value.hint
    import datasets  # the train extra
    ds = datasets.Dataset(datasets.table.InMemoryTable(_table(RECORDS[:3])))
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match="several splits") as info:
        list(read_records(tmp_path / "dd"))
    assert str(tmp_path / "dd" / "train") in info.value.hint
    with pytest.raises(DataError, match="not a dataset directory"):
        list(read_records(tmp_path))


def _validate(tmp_path: Path, dataset: list[str], extra: str = "") -> subprocess.CompletedProcess:
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[job]\nname = "d"\n[slurm]\ntime = "00:10:00"\n[train]\nmodel = "tiny-llama"\n'
                    f"dataset = {json.dumps(dataset)}\n{extra}")
    return subprocess.run([sys.executable, "-m", "swiftslurm", "validate", str(spec)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120, env={**os.environ, "SWIFTSLURM_DEBUG": "0"})


def test_validate_names_a_malformed_record_in_parquet_and_jsonl(tmp_path):
    good = _jsonl(tmp_path / "good.jsonl", RECORDS)
    bad_rows = RECORDS[:4]
    pq.write_table(_table(bad_rows[:4] + [{"instruction": "a", "output": None}]), tmp_path / "bad.parquet")
    r = _validate(tmp_path, [str(good), "bad.parquet"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{tmp_path / 'bad.parquet'}, row index 4: alpaca field 'output' must be a string" in r.stderr
    assert "HINT:" in r.stderr
    lines = (tmp_path / "good.jsonl").read_text().splitlines()
    lines[6] = lines[6].replace('"output"', '"outptu"').replace('"messages"', '"mesages"')
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    r = _validate(tmp_path, ["good.jsonl", "bad.jsonl"])
    assert r.returncode == 2 and f"{tmp_path / 'bad.jsonl'}, line 7:" in r.stderr, r.stderr
    r = _validate(tmp_path, ["good.jsonl", "bad.jsonl"], "dataset_scan = false\n")
    assert r.returncode == 0 and "not scanned" in r.stdout, r.stderr
    r = _validate(tmp_path, ["good.jsonl"])
    assert r.returncode == 0 and f"{len(RECORDS)} record(s) in 1 file(s) checked" in r.stdout


def test_a_directory_cache_is_reused_and_rebuilt_when_a_shard_changes(tmp_path, tok):
    saved = _save_to_disk(tmp_path / "saved", RECORDS)
    first = datacache.cached_dataset([str(saved)], tok, 128, tmp_path / "cache")
    again = datacache.cached_dataset([str(saved)], tok, 128, tmp_path / "cache")
    assert first.tokenized_now and not again.tokenized_now and again.directory == first.directory
    identity = dataset_identity(str(saved))  # what a resume compares
    shards = sorted(saved.glob("*.arrow"))
    table = pa.ipc.open_stream(shards[0].read_bytes()).read_all()  # not mapped: the file is rewritten below
    changed = table.set_column(table.schema.get_field_index("output"), "output",
                               pa.array([None if v is None else v + "!" for v in table["output"].to_pylist()], pa.string()))
    with pa.OSFile(str(shards[0]), "wb") as sink, pa.ipc.new_stream(sink, changed.schema) as writer:
        writer.write_table(changed)
    rebuilt = datacache.cached_dataset([str(saved)], tok, 128, tmp_path / "cache")
    assert rebuilt.tokenized_now and rebuilt.directory != first.directory
    assert any(tok.decode(rebuilt[i]["input_ids"]).endswith("!</s>") for i in range(len(rebuilt)))
    assert dataset_identity(str(saved)) != identity and "data-00000-of-00003.arrow" in identity


def test_validate_refuses_an_empty_dataset_and_a_file_that_is_not_its_format(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    r = _validate(tmp_path, ["empty.jsonl"])
    assert r.returncode == 2 and "the dataset holds no record" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "d.arrow").write_text('{"instruction": "a", "output": "b"}\n')
    r = _validate(tmp_path, ["d.arrow"])
    assert r.returncode == 2 and "cannot read the arrow file" in r.stderr and "Traceback" not in r.stderr
