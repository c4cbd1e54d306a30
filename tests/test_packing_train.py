"""Packing through the real trainer (2 CPU ranks, DeepSpeed ZeRO-2, tiny-llama, rows of 256 tokens that hold
2-3 demo samples): the metrics report padding, a walltime stop + resume reproduces the uninterrupted
losses bitwise, and the resumed start reads the tokenized cache instead of tokenizing again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_train import losses, quickstart_spec, run

from swiftslurm.taskdir import SUMMARY_FILE
from swiftslurm.taskdir import TOKEN_CACHE_DIR as CACHE_DIR

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
TRAIN = dict(max_length=256, max_steps=10, save_steps=100, logging_steps=1, per_device_train_batch_size=2,
             report_to=["none"], packing=True,
             dataset=[str(ROOT / "examples/data/alpaca_demo.jsonl"), str(ROOT / "examples/data/messages_demo.jsonl")])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packed")
    spec, out = quickstart_spec(tmp, "reference", **TRAIN)
    return run(spec, out), out, tmp


def test_packed_run_reports_useful_tokens_and_padding(reference):
    results, out, _ = reference
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 10
    for r in steps:
        assert r["total_tokens"] == 2 * 2 * 256  # 2 ranks x 2 rows x 256: static rows
        assert 0 < r["useful_tokens"] < r["total_tokens"]
        assert r["padding_ratio"] == pytest.approx(1 - r["useful_tokens"] / r["total_tokens"])
        assert r["useful_tokens_per_s"] > 0 and r["samples_per_s"] > r["useful_tokens_per_s"] / 256  # > 1 sample per row
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["useful_tokens"] == sum(r["useful_tokens"] for r in steps)
    assert summary["total_tokens"] == 10 * 1024 and summary["packing"] is True
    assert 0 < summary["padding_ratio"] < 0.5 and summary["useful_tokens_per_s"] > 0
    assert summary["attn_implementation"] == "sdpa" and summary["liger"] == "off"
    assert "useful tokens/s" in results[0]["stdout"] and "packing on" in results[0]["stdout"]


def test_walltime_stop_and_resume_with_packing_reproduce_the_losses(reference):
    _, ref_out, tmp = reference
    spec, out = quickstart_spec(tmp, "requeued", **TRAIN)
    first = run(spec, out, stop_at_step=5)
    assert [r["global_step"] for r in first] == [5, 5] and first[0]["stopped_for_requeue"]
    assert "tokenized" in first[0]["stdout"]
    second = run(spec, out, resume=str(out / "checkpoint-5"))
    assert second[0]["global_step"] == 10
    assert "tokenized" not in second[0]["stdout"]  # the requeue read the cache
    assert len(list((out / CACHE_DIR).iterdir())) == 1
    reference_losses, resumed = losses(ref_out), losses(out)
    assert [resumed[s] for s in range(6, 11)] == [reference_losses[s] for s in range(6, 11)]
