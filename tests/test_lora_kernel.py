"""``train.fused_lora`` (train/kernels/lora.py): the fused LoRA projection computes peft's function, draws peft's
dropout masks, and hands every case it does not cover back to peft (issue #34). Real peft modules on the CPU."""

from __future__ import annotations

import copy

import pytest
import torch

from swiftslurm.train.kernels import lora as fused_lora


class Block(torch.nn.Module):
    """Two projections as in a decoder layer: one with a bias (Qwen's q/k/v), one without, a nonlinearity between."""

    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(16, 24, bias=True)
        self.o_proj = torch.nn.Linear(24, 16, bias=False)

    def forward(self, x):
        return self.o_proj(torch.nn.functional.gelu(self.q_proj(x)))


def peft_pair(dropout: float, **config):
    """(peft's model, a deep copy with the fused forward): the same weights, B not zero so the adapter counts."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(Block(), LoraConfig(r=4, lora_alpha=12, lora_dropout=dropout, target_modules=["q_proj", "o_proj"], **config))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    fused = copy.deepcopy(model)
    return model, fused, fused_lora.fuse_lora(fused)


def step(model, x, seed: int = 1, checkpoint: bool = False):
    """Output and gradients (input, then every trainable parameter by name) of one forward/backward under ``seed``."""
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    y = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False) if checkpoint else model(x)
    y.square().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return y.detach(), x.grad, grads


def assert_same(a, b, tol: float = 3e-4):  # fp32; the adapter is added in another order (scaled before B)
    (ya, gxa, ga), (yb, gxb, gb) = a, b
    torch.testing.assert_close(ya, yb, rtol=tol, atol=tol)
    torch.testing.assert_close(gxa, gxb, rtol=tol, atol=tol)
    assert ga.keys() == gb.keys() and len(ga) == 4  # lora_A and lora_B of both projections
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_same_function_and_gradients_as_peft(dropout):
    model, fused, count = peft_pair(dropout)
    assert count == 2
    x = torch.randn(2, 7, 16)
    calls = []
    original = fused_lora.LoraLinear.apply
    fused_lora.LoraLinear.apply = lambda *a: calls.append(1) or original(*a)
    try:
        assert_same(step(model, x), step(fused, x))  # with dropout: the same masks, drawn in the same order
    finally:
        fused_lora.LoraLinear.apply = original
    assert len(calls) == 2  # the fused function ran, once per projection


def test_dropout_masks_are_peft_s_under_gradient_checkpointing():
    model, fused, _ = peft_pair(0.5)
    x = torch.randn(3, 5, 16)
    assert_same(step(model, x, checkpoint=True), step(fused, x, checkpoint=True))
    # and they are masks: another seed gives other gradients
    other = step(fused, x, seed=2, checkpoint=True)
    assert not torch.allclose(other[1], step(model, x, checkpoint=True)[1])


def test_a_frozen_first_input_gets_no_gradient_and_the_adapter_still_learns():
    model, fused, _ = peft_pair(0.0)
    x = torch.randn(2, 4, 16)  # no requires_grad: layer 0's input when the embedding is frozen
    for m in (model, fused):
        torch.manual_seed(1)
        m(x).square().sum().backward()
    for (name, a), (_, b) in zip(model.named_parameters(), fused.named_parameters(), strict=True):
        if a.requires_grad:
            torch.testing.assert_close(a.grad, b.grad, rtol=3e-4, atol=3e-4, msg=name)


def counted(model, x, **kwargs):
    """How many times the fused function ran in one forward of ``model``."""
    calls = []
    original = fused_lora.LoraLinear.apply
    fused_lora.LoraLinear.apply = lambda *a: calls.append(1) or original(*a)
    try:
        model(x, **kwargs)
    finally:
        fused_lora.LoraLinear.apply = original
    return len(calls)


def test_cases_it_does_not_cover_run_peft_s_own_forward():
    model, fused, _ = peft_pair(0.1)
    x = torch.randn(2, 3, 16)
    assert counted(fused, x) == 2
    with fused.disable_adapter(), model.disable_adapter():  # DPO's reference pass
        assert counted(fused, x) == 0
        torch.testing.assert_close(fused(x), model(x))
    fused.eval()  # dropout off: still fused, and peft's eval output
    model.eval()
    assert counted(fused, x) == 2
    torch.testing.assert_close(fused(x), model(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast picks dtypes per op: peft's path
        assert counted(fused, x) == 0
    fused.merge_adapter()
    assert counted(fused, x) == 0
    torch.testing.assert_close(fused(x), model(x), rtol=1e-4, atol=1e-4)


def test_dora_and_trainable_bases_keep_peft_s_forward():
    _, dora, count = peft_pair(0.0, use_dora=True)
    assert count == 2 and counted(dora, torch.randn(1, 2, 16)) == 0  # a LoRA variant: decided per call
    _, fused, _ = peft_pair(0.0)
    fused.base_model.model.q_proj.base_layer.weight.requires_grad_(True)
    assert counted(fused, torch.randn(1, 2, 16)) == 1  # o_proj only


def test_zero3_partitioned_weights_are_never_fused():
    """ZeRO-3 gathers a weight in hooks on the module's own forward; its parameters carry ``ds_id``."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(Block(), LoraConfig(r=4, target_modules=["q_proj", "o_proj"]))
    model.base_model.model.q_proj.base_layer.weight.ds_id = 7
    assert fused_lora.fuse_lora(model) == 1
    fused = get_peft_model(Block(), LoraConfig(r=4, target_modules=["q_proj", "o_proj"]))
    assert fused_lora.fuse_lora(fused) == 2
    fused.base_model.model.o_proj.base_layer.weight.ds_id = 8  # partitioned after fuse_lora: peft's path at the call
    assert counted(fused, torch.randn(1, 2, 16)) == 1


def test_the_spec_key_defaults_on_and_turns_off():
    from swiftslurm.spec import validate_spec

    train = {"model": "tiny-llama", "dataset": ["x.jsonl"], "dataset_scan": False}
    assert validate_spec({"train": train}).train.fused_lora is True
    assert validate_spec({"train": {**train, "fused_lora": False}}).train.fused_lora is False
