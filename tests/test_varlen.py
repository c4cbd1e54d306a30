"""train/varlen.py: packed rows through PyTorch's varlen flash kernel, registered as a transformers attention.

There is no flash kernel on a CPU, so a reference kernel (sdpa over each sample, the signature of torch's
``varlen_attn``) stands in for it; what is tested is everything around the kernel: the layout, the
boundaries the collator sends, GQA, the scale, the causal flag for each torch signature, and that a real
Llama trained through it computes what sdpa with the packed-sequence mask computes (loss and every gradient)."""

from __future__ import annotations

import random

import pytest
import torch

from swiftslurm.train.data.packing import STATS_PREFIX, PackingCollator  # noqa: E402
from swiftslurm.train.kernels import varlen  # noqa: E402


def reference_kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """torch 2.12's varlen_attn, computed sample by sample with sdpa."""
    assert q.dim() == 3 and k.shape[0] == q.shape[0] and cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)
    assert max_q == int((cu_q[1:] - cu_q[:-1]).max())
    outs = []
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        o = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
            is_causal=window_size == (-1, 0), scale=scale, enable_gqa=enable_gqa)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def torch_2_10_kernel(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False):
    """torch 2.10's signature: no scale, no GQA (equal heads required), ``is_causal``."""
    assert q.shape[1] == k.shape[1], "torch 2.10's varlen_attn needs as many key/value heads as query heads"
    return reference_kernel(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, 0) if is_causal else (-1, -1))


class FakeAtenFlash:
    """aten's variable-length flash forward and backward on the CPU (sdpa per sample; the backward recomputes it under
    autograd), with the state a real kernel keeps between the two: the backward must get back the very output and
    log-sum-exp its forward returned, and the forward's boundaries, lengths and scale."""

    def __init__(self) -> None:
        self.saved: list[tuple] = []
        self.forwards = self.backwards = 0

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale=None):
        assert (dropout_p, is_causal, return_debug_mask) == (0.0, True, False) and q.shape[1] % k.shape[1] == 0
        out = reference_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0), enable_gqa=k.shape[1] != q.shape[1])
        lse, rng, unused = torch.randn(q.shape[1], q.shape[0]), torch.zeros(2), torch.empty(0)
        self.saved.append((out, lse, rng, cu_q, max_q, scale))
        self.forwards += 1
        return out, lse, rng, unused, torch.empty(0)

    def backward(self, grad, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng, unused, *, scale=None):
        def same(a, b):  # the very tensor (autograd hands saved tensors back as new objects over the same memory)
            return a.data_ptr() == b.data_ptr() and a.shape == b.shape

        assert any(same(out, o) and same(lse, s) and same(rng, r) and same(cu_q, c) and max_q == m and scale == sc
                   for o, s, r, c, m, sc in self.saved), "the backward did not get what its forward saved"
        assert same(cu_k, cu_q) and max_k == max_q and grad.is_contiguous()
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            again = reference_kernel(*leaves, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0),
                                     enable_gqa=k.shape[1] != q.shape[1])
            self.backwards += 1
            return torch.autograd.grad(again, leaves, grad)


@pytest.fixture
def kernel():
    varlen.register()
    yield lambda fn: varlen.use_kernel(fn)
    varlen.use_kernel(None)


def rows(seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    out = []
    for lengths in ([5, 7, 3], [10, 4], [15], [2, 2, 2, 2]):
        row = []
        for n in lengths:
            ids = [rng.randrange(3, 60) for _ in range(n)]
            row.append({"input_ids": ids, "labels": list(ids)})
        out.append(row)
    return out


def gqa_llama(impl: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, use_cache=False, pad_token_id=0)
    model = LlamaForCausalLM(config)
    model.set_attn_implementation(impl)
    return model


def loss_and_grads(impl: str, batch: dict) -> tuple[float, dict]:
    model = gqa_llama(impl)
    out = model(**{k: v for k, v in batch.items() if not k.startswith(STATS_PREFIX)})
    out.loss.backward()
    return out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("fn", [reference_kernel, torch_2_10_kernel, "aten"], ids=["torch>=2.12", "torch-2.10", "aten-flash-ops"])
def test_a_gqa_llama_through_varlen_matches_sdpa_with_the_packed_mask(kernel, fn, monkeypatch):
    """The default kernel is swiftslurm's own autograd node over aten's flash ops (faked here: no flash on a CPU),
    which takes the 2 key/value heads as they are; torch's varlen_attn signatures stand in for the others."""
    fake = FakeAtenFlash()
    if fn == "aten":
        monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", fake.forward)
        monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", fake.backward)
        fn = None
    kernel(fn)
    masked = loss_and_grads("sdpa", PackingCollator(16, 0)(rows()))
    ours = loss_and_grads(varlen.NAME, PackingCollator(16, 0, boundaries=True)(rows()))
    assert ours[0] == pytest.approx(masked[0], abs=1e-5)
    assert ours[1].keys() == masked[1].keys()
    for name, grad in masked[1].items():
        assert torch.allclose(ours[1][name], grad, atol=1e-5), name
    if fn is None:  # one forward and one backward per layer (2 layers), through the fake
        assert (fake.forwards, fake.backwards) == (2, 2)


def test_packed_rows_skip_the_mask_preparation_that_reads_the_gpu_and_a_padding_mask_is_refused(kernel, monkeypatch):
    """No mask function is registered with varlen_attn, so transformers' mask preparation returns at once: its
    packed-sequence detection (``find_packed_sequence_indices``, an ``.all()`` the host waits for the GPU to answer,
    at every forward) never runs. Under sdpa it does (the counter counts). The trainer's model then refuses a
    padding mask (a hook), where transformers would otherwise drop it."""
    import transformers.masking_utils as masking

    from swiftslurm.spec import validate_spec
    from swiftslurm.train.build import load_model_and_tokenizer

    kernel(reference_kernel)
    calls = []
    real = masking.find_packed_sequence_indices
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda *a, **k: calls.append(1) or real(*a, **k))
    loss_and_grads("sdpa", PackingCollator(16, 0)(rows()))
    assert calls, "sdpa reads the packed mask: the detection ran"
    calls.clear()
    loss_and_grads(varlen.NAME, PackingCollator(16, 0, boundaries=True)(rows()))
    assert calls == []
    spec = validate_spec({"train": {"model": "tiny-llama", "dataset": ["d.jsonl"], "max_length": 16}})
    model, _ = load_model_and_tokenizer(spec, False, varlen.NAME)
    ids = torch.randint(3, 60, (2, 8))
    for call in (lambda: model(input_ids=ids, attention_mask=torch.ones_like(ids)), lambda: model(ids, torch.ones_like(ids))):
        with pytest.raises(ValueError, match="cannot apply a padding mask"):
            call()
    model.set_attn_implementation("sdpa")  # a model moved off the kernel takes masks again
    assert model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.shape[:2] == (2, 8)


def test_a_moved_boundary_changes_the_loss(kernel):
    """The comparison above can fail: the same rows with one sample boundary dropped (two samples read as
    one) give another loss."""
    kernel(reference_kernel)
    batch = PackingCollator(16, 0, boundaries=True)(rows())
    good = loss_and_grads(varlen.NAME, batch)[0]
    cu = batch["cu_seq_lens_q"]
    merged = torch.cat([cu[:1], cu[2:]])  # samples 1 and 2 of row 1 become one sequence
    batch.update(cu_seq_lens_q=merged, cu_seq_lens_k=merged, max_length_q=int((merged[1:] - merged[:-1]).max()))
    assert abs(loss_and_grads(varlen.NAME, batch)[0] - good) > 1e-4


def test_boundaries_are_every_sample_start_over_the_rows_laid_end_to_end():
    batch = PackingCollator(8, 0, boundaries=True)([[{"input_ids": [5, 6, 7], "labels": [5, 6, 7]},
                                                      {"input_ids": [8, 9], "labels": [8, 9]}],
                                                     [{"input_ids": [4] * 8, "labels": [4] * 8}]])
    # row 0: a(3) b(2) pad(3); row 1: one sample of 8
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 8, 16] and batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["max_length_q"] == 8 and batch["max_length_k"] == 8
    assert "cu_seq_lens_q" not in PackingCollator(8, 0)([[{"input_ids": [5, 6], "labels": [5, 6]}]])
    with pytest.raises(ValueError, match="start every row at 0"):
        varlen.boundaries(torch.tensor([[1, 2, 0, 1]]))


def test_under_sequence_parallel_the_boundaries_come_from_the_gathered_position_ids(kernel):
    """Ulysses SP shards every batch tensor along the sequence, so the collator sends no boundaries there; the
    attention wrapper hands the kernel the whole rows' position_ids, and the samples stay apart as with the
    collator's boundaries (and as sdpa with the packed mask)."""
    kernel(reference_kernel)
    masked = loss_and_grads("sdpa", PackingCollator(16, 0)(rows()))
    sp_batch = PackingCollator(16, 0, boundaries=False)(rows())
    assert "cu_seq_lens_q" not in sp_batch and "position_ids" in sp_batch
    ours = loss_and_grads(varlen.NAME, sp_batch)
    assert ours[0] == pytest.approx(masked[0], abs=1e-5)
    for name, grad in masked[1].items():
        assert torch.allclose(ours[1][name], grad, atol=1e-5), name


def test_without_boundaries_every_row_is_one_causal_sequence(kernel):
    """A batch that did not come from the packing collator (unpadded rows): the same as sdpa's causal mask."""
    kernel(reference_kernel)
    ids = torch.randint(3, 60, (3, 12), generator=torch.Generator().manual_seed(1))
    masked = loss_and_grads("sdpa", {"input_ids": ids, "labels": ids})
    ours = loss_and_grads(varlen.NAME, {"input_ids": ids, "labels": ids})
    assert ours[0] == pytest.approx(masked[0], abs=1e-5)


def test_a_scale_the_kernel_cannot_take_is_folded_into_the_queries(kernel):
    kernel(torch_2_10_kernel)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 4, 6, 12], dtype=torch.int32)
    out, _ = varlen.attention(None, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, max_length_q=6)
    varlen.use_kernel(reference_kernel)
    expected, _ = varlen.attention(None, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, max_length_q=6)
    assert out.shape == (2, 6, 4, 8) and torch.allclose(out, expected, atol=1e-6)


def test_a_padding_mask_or_dropout_is_refused_not_ignored(kernel):
    kernel(reference_kernel)
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="cannot apply a padding mask"):
        varlen.attention(None, q, q, q, torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="no attention dropout"):
        varlen.attention(None, q, q, q, None, dropout=0.1)
