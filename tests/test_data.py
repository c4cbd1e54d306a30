"""SFT data: alpaca and messages formats, prompt masking, truncation, errors naming file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swiftslurm.errors import SwiftSlurmError
from swiftslurm.train.data.tokens import IGNORE_INDEX, Collator, DataError, encode, load_dataset
from swiftslurm.train.tinymodel import build_tokenizer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "data"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def trained_text(tok, ex) -> str:
    return tok.decode([i for i, lab in zip(ex["input_ids"], ex["labels"], strict=True) if lab != IGNORE_INDEX])


def test_alpaca_labels_only_the_response(tok):
    ex = encode("alpaca", {"instruction": "Describe the cat.", "input": "color: red", "output": "The cat is red."}, tok, 512)
    assert trained_text(tok, ex) == "The cat is red.</s>"
    full = tok.decode(ex["input_ids"])
    assert full.startswith("### Instruction:\nDescribe the cat.\n\n### Input:\ncolor: red") and full.endswith("red.</s>")
    assert len(ex["input_ids"]) == len(ex["labels"]) == len(ex["attention_mask"])


def test_messages_label_every_assistant_turn_and_nothing_else(tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2"}]
    ex = encode("messages", msgs, tok, 512)
    assert trained_text(tok, ex) == "A1</s>\nA2</s>\n"
    assert "Q1" in tok.decode(ex["input_ids"]) and "Q1" not in trained_text(tok, ex)


def test_truncation_to_max_length_and_drop_when_no_label_left(tok):
    rec = {"instruction": "x" * 50, "output": "yyyy"}
    prompt_tokens = len("### Instruction:\n" + "x" * 50 + "\n\n### Response:\n")  # one token per byte
    assert encode("alpaca", rec, tok, prompt_tokens) is None  # nothing of the response is left
    ex = encode("alpaca", rec, tok, prompt_tokens + 2)
    assert len(ex["input_ids"]) == prompt_tokens + 2 and trained_text(tok, ex) == "yy"


def test_shipped_datasets_load(tok):
    ds = load_dataset([str(EXAMPLES / "alpaca_demo.jsonl"), str(EXAMPLES / "messages_demo.jsonl")], tok, 128)
    assert len(ds) == 60 and ds.dropped == 0
    assert all(any(lab != IGNORE_INDEX for lab in ex["labels"]) for ex in ds.examples)


def test_json_list_file(tmp_path, tok):
    f = tmp_path / "d.json"
    f.write_text(json.dumps([{"instruction": "a", "output": "b"}, {"messages": [{"role": "user", "content": "q"},
                                                                               {"role": "assistant", "content": "r"}]}]))
    assert len(load_dataset([str(f)], tok, 64)) == 2


BAD = [
    ('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": 3}\n', 2, "'output' must be a string"),
    ('{"instruction": "a", "output": "b"}\n\n{not json\n', 3, "not valid JSON"),
    ('{"prompt": "a", "completion": "b"}\n', 1, "neither alpaca nor messages"),
    ('{"messages": [{"role": "user", "content": "hi"}]}\n', 1, "at least one assistant"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}\n', 1, "'role'"),
    ('[1, 2]\n', 1, "JSON object"),
]


@pytest.mark.parametrize("text,line,what", BAD)
def test_malformed_record_names_file_and_line(tmp_path, tok, text, line, what):
    f = tmp_path / "bad.jsonl"
    f.write_text(text)
    with pytest.raises(DataError) as info:
        load_dataset([str(f)], tok, 64)
    err = info.value
    assert isinstance(err, SwiftSlurmError) and err.hint
    assert f"{f}, line {line}" in err.what and what in err.what


def test_missing_file_is_a_user_error(tmp_path, tok):
    with pytest.raises(DataError, match="not found"):
        load_dataset([str(tmp_path / "nope.jsonl")], tok, 64)


def test_collator_pads_right(tok):
    batch = Collator(tok.pad_token_id)([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "attention_mask": [1, 1, 1]},
                                        {"input_ids": [8], "labels": [8], "attention_mask": [1]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
