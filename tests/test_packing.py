"""Padding-free packing on the real tiny Llama (CPU): rows, labels at boundaries, the packed-sequence
mask (attention never crosses a sample), packed == unpacked per-token losses, the meter's counts."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from swiftslurm.train.data import packing
from swiftslurm.train.data.tokens import IGNORE_INDEX, Collator, SFTDataset, load_dataset
from swiftslurm.train.health.metrics import STATS_PREFIX, StepMeter
from swiftslurm.train.tinymodel import build_model, build_tokenizer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "data"
ROW = 256


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def samples(tok):
    return load_dataset([str(EXAMPLES / "alpaca_demo.jsonl"), str(EXAMPLES / "messages_demo.jsonl")], tok, ROW)


def model_for(impl: str, tok, prepared: bool = True):
    model = build_model(len(tok), ROW, seed=3)
    model.set_attn_implementation(impl)
    model.train()  # the training forward: dropout is 0 in the tiny config, so outputs are deterministic
    if prepared:
        packing.prepare_model(model)
    return model


def model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if not k.startswith(STATS_PREFIX)}


def lognormal_lengths(n: int, seed: int, cap: int) -> list[int]:
    rng = random.Random(seed)
    return [max(1, min(cap, int(rng.lognormvariate(5.4, 0.6)))) for _ in range(n)]


# ---- rows


def test_every_sample_lands_in_exactly_one_row_that_fits():
    lengths = lognormal_lengths(3000, seed=1, cap=2048)
    rows = packing.pack_rows(lengths, 2048, seed=7)
    placed = sorted(i for row in rows for i in row)
    assert placed == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 2048 for row in rows)
    padding = 1 - sum(lengths) / (len(rows) * 2048)
    assert padding < 0.05, padding  # alpaca-like lengths (median ~220) in 2048-token rows


def test_rows_are_a_function_of_lengths_and_seed():
    lengths = [random.Random(2).choice([10, 20, 30]) for _ in range(500)]
    assert packing.pack_rows(lengths, 64, seed=5) == packing.pack_rows(list(lengths), 64, seed=5)
    assert packing.pack_rows(lengths, 64, seed=5) != packing.pack_rows(lengths, 64, seed=6)  # ties follow the seed


def test_a_sample_longer_than_a_row_is_refused():
    with pytest.raises(ValueError, match="rows hold 1..8"):
        packing.pack_rows([3, 9], 8, seed=0)


def test_packed_row_layout_labels_never_cross_a_boundary(tok):
    a = {"input_ids": [5, 6, 7], "labels": [5, 6, 7]}
    b = {"input_ids": [8, 9], "labels": [IGNORE_INDEX, 9]}
    batch = packing.PackingCollator(8, tok.pad_token_id)([[a, b], [b]])
    assert "attention_mask" not in batch
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0], [8, 9, 0, 0, 0, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4, 5]]
    # the first token of each sample and every pad position carry no label
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, -100, -100], [-100, 9] + [-100] * 6]
    assert batch[packing.REAL_TOKENS].tolist() == [5, 2] and batch[packing.SAMPLES].tolist() == [2, 1]
    flat = packing.PackingCollator(8, tok.pad_token_id, flatten=True)([[a, b], [b]])
    assert flat["input_ids"].shape == (1, 16) and flat["position_ids"][0, 8:].tolist() == [0, 1, 0, 1, 2, 3, 4, 5]


# ---- the mask


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_attention_never_crosses_a_sample(tok, samples, impl):
    """Changing sample A's tokens changes nothing of sample B's logits in the same packed row."""
    a, b = samples[0], samples[1]
    model = model_for(impl, tok)
    collate = packing.PackingCollator(ROW, tok.pad_token_id)
    changed = dict(a, input_ids=[(t + 1) % len(tok) for t in a["input_ids"]])
    with torch.no_grad():
        before = model(**model_inputs(collate([[a, b]]))).logits[0]
        after = model(**model_inputs(collate([[changed, b]]))).logits[0]
    n_a, n_b = len(a["input_ids"]), len(b["input_ids"])
    assert (before[:n_a] - after[:n_a]).abs().max() > 1e-2  # A's own logits did change
    assert torch.equal(before[n_a:n_a + n_b], after[n_a:n_a + n_b])


def per_token_losses(model, batch: dict) -> list[float]:
    """Cross-entropy of every label-bearing position, in order (row-major)."""
    with torch.no_grad():
        logits = model(**model_inputs(batch)).logits
    labels = batch["labels"]
    logits, targets = logits[:, :-1], labels[:, 1:]
    keep = targets != IGNORE_INDEX
    losses = torch.nn.functional.cross_entropy(logits[keep], targets[keep], reduction="none")
    return losses.tolist()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_and_unpacked_give_the_same_per_token_losses(tok, samples, impl):
    model = model_for(impl, tok)
    rows = packing.PackedDataset(samples, ROW, seed=11)
    batch_rows = [rows[i] for i in range(4)]
    assert max(len(r) for r in batch_rows) >= 2  # real packing: several samples share a row
    packed = per_token_losses(model, packing.PackingCollator(ROW, tok.pad_token_id)(batch_rows))
    unpacked_batch = Collator(tok.pad_token_id)([ex for row in batch_rows for ex in row])  # padded, with a mask
    unpacked = per_token_losses(model, unpacked_batch)
    assert len(packed) == len(unpacked) > 100
    assert max(abs(x - y) for x, y in zip(packed, unpacked, strict=True)) < 1e-4


def test_the_equivalence_check_catches_a_boundary_that_is_not_restarted(tok, samples):
    """The same comparison fails when one sample's positions continue its neighbour's (no boundary)."""
    model = model_for("sdpa", tok)
    a, b = samples[0], samples[1]
    batch = packing.PackingCollator(ROW, tok.pad_token_id)([[a, b]])
    n_a = len(a["input_ids"])
    broken = dict(batch, position_ids=batch["position_ids"].clone())
    broken["position_ids"][0, n_a:n_a + len(b["input_ids"])] += n_a  # B continues A: one long sequence
    good, bad = per_token_losses(model, batch), per_token_losses(model, broken)
    assert max(abs(x - y) for x, y in zip(good, bad, strict=True)) > 1e-3


# ---- what the meter counts


def test_meter_counts_useful_and_total_tokens_and_samples(tok):
    a = {"input_ids": [5, 6, 7], "labels": [5, 6, 7], "attention_mask": [1, 1, 1]}
    b = {"input_ids": [8, 9], "labels": [8, 9], "attention_mask": [1, 1]}
    meter = StepMeter()
    batch = packing.PackingCollator(8, tok.pad_token_id)([[a, b], [b]])
    meter.add_batch(batch, 0.0)
    assert not any(k.startswith(STATS_PREFIX) for k in batch)  # taken out before the forward pass
    assert (meter.tokens, meter.total_tokens, meter.samples) == (7, 16, 3)
    meter.add_batch(Collator(tok.pad_token_id)([a, b]), 0.0)  # padded: 5 of 6 positions are real
    assert (meter.tokens, meter.total_tokens, meter.samples) == (12, 22, 5)
    meter.steps, meter.step_s = 1, 2.0
    out = meter.summary(12, 5, world_total_tokens=22)
    assert out["useful_tokens_per_s"] == out["tokens_per_s"] == 6.0
    assert out["padding_ratio"] == pytest.approx(10 / 22) and out["useful_tokens"] == 12 and out["total_tokens"] == 22


class OnDevice(torch.Tensor):
    """A batch tensor as Accelerate hands it over on a GPU (``is_cuda``), whose reads on the host are counted:
    each ``int()`` / ``.item()`` of a GPU tensor waits for the GPU."""

    reads = 0

    @property
    def is_cuda(self):
        return True

    def __int__(self):
        OnDevice.reads += 1
        return int(self.as_subclass(torch.Tensor))

    def item(self):
        OnDevice.reads += 1
        return self.as_subclass(torch.Tensor).item()


def test_meter_reads_counts_on_the_gpu_once_per_logging_step(tok):
    """Batches already on the GPU are counted there: no host read per step (each would be a sync), one at
    ``settle``; the totals are those of the same batches counted on the CPU."""
    a = {"input_ids": [5, 6, 7], "labels": [5, 6, 7], "attention_mask": [1, 1, 1]}
    b = {"input_ids": [8, 9], "labels": [8, 9], "attention_mask": [1, 1]}
    batches = [packing.PackingCollator(8, tok.pad_token_id)([[a, b], [b]]), Collator(tok.pad_token_id)([a, b])] * 3
    on_cpu, on_gpu = StepMeter(), StepMeter()
    OnDevice.reads = 0
    for batch in batches:
        on_cpu.add_batch(dict(batch), 0.0)
        on_gpu.add_batch({k: v.as_subclass(OnDevice) for k, v in batch.items()}, 0.0)
    assert OnDevice.reads == 0 and on_gpu.tokens < on_cpu.tokens
    on_gpu.settle()
    assert 0 < OnDevice.reads <= 2  # tokens and samples, once each
    assert (on_gpu.tokens, on_gpu.total_tokens, on_gpu.samples) == (on_cpu.tokens, on_cpu.total_tokens, on_cpu.samples) == (36, 66, 15)
    on_gpu.settle()  # nothing left to read
    assert on_gpu.tokens == 36


def test_padding_ratio_of_packed_rows(tok):
    lengths = lognormal_lengths(400, seed=3, cap=512)
    ds = SFTDataset([{"input_ids": [7] * n, "labels": [7] * n, "attention_mask": [1] * n} for n in lengths])
    rows = packing.PackedDataset(ds, 2048, seed=0)
    assert rows.padding_ratio() < 0.05
    assert rows.padding_ratio() == pytest.approx(1 - sum(lengths) / (len(rows) * 2048))
