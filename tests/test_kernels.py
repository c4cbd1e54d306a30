"""train.attn_implementation / train.use_liger_kernel: what "auto" picks on each kind of node, and the
one-message refusals (pure decisions over NodeFacts)."""

from __future__ import annotations

import pytest

from swiftslurm.errors import SwiftSlurmError
from swiftslurm.spec import validate_spec
from swiftslurm.train.kernels.choose import FLEX_MIN_ROW, KernelError, NodeFacts, fit_to_model, liger_names, resolve_attention, resolve_liger

CPU, GPU = NodeFacts(cuda=False), NodeFacts(cuda=True)
GPU_ALL = NodeFacts(cuda=True, flash_attn=True, liger=True)
GPU_VARLEN = NodeFacts(cuda=True, varlen=True)  # an sm80+ GPU: torch's flash kernel for packed samples


@pytest.mark.parametrize("node,packing,row,expected", [
    (CPU, True, 8192, "sdpa"), (CPU, False, 8192, "sdpa"),
    (GPU, True, 8192, "flex_attention"),  # long packed rows of one static shape: flex skips the masked blocks
    (GPU, True, FLEX_MIN_ROW, "flex_attention"), (GPU, True, FLEX_MIN_ROW - 1, "sdpa"),
    (GPU, True, 2048, "sdpa"),  # short packed rows: sdpa with the packed-sequence mask measured faster on an H200
    (GPU, False, 8192, "sdpa"),  # padded batches change shape every step: flex would recompile
    (GPU_ALL, True, 2048, "flash_attention_2"), (NodeFacts(cuda=False, flash_attn=True), True, 8192, "sdpa"),
    # the flash kernel for packed samples wherever it runs, for packed rows of any length (but not padded batches)
    (GPU_VARLEN, True, 2048, "varlen_attn"), (GPU_VARLEN, True, 8192, "varlen_attn"), (GPU_VARLEN, False, 2048, "sdpa"),
    (NodeFacts(cuda=True, flash_attn=True, varlen=True), True, 2048, "flash_attention_2"),
])
def test_auto_attention(node, packing, row, expected):
    attn, why = resolve_attention("auto", packing, node, row, half=True)
    assert attn == expected and why.startswith("auto")


def test_auto_takes_no_flash_kernel_for_fp32_training():
    """Flash kernels have no fp32 path: an fp32 run with packed rows keeps the masked kernels."""
    assert resolve_attention("auto", True, GPU_VARLEN, 2048, half=False)[0] == "sdpa"
    assert resolve_attention("auto", True, GPU_VARLEN, 8192, half=False)[0] == "flex_attention"


@pytest.mark.parametrize("node,what", [(CPU, "needs a CUDA GPU"), (GPU, "needs torch's flash kernel on an sm80")])
def test_explicit_varlen_where_the_node_cannot_run_it_is_one_clear_error(node, what):
    """What the node decides; what the spec alone rules out (no packing, no bf16/fp16) validate refuses (below)."""
    with pytest.raises(KernelError, match=what) as info:
        resolve_attention("varlen_attn", True, node, 2048)
    assert info.value.hint
    assert resolve_attention("varlen_attn", True, GPU_VARLEN, 2048)[0] == "varlen_attn"


@pytest.mark.parametrize("head_dim,fits", [(64, True), (128, True), (256, True), (80, True), (72, True), (60, False), (320, False)])
def test_the_flash_kernel_is_checked_against_the_loaded_models_head_dimension(head_dim, fits):
    """auto falls back to sdpa (saying why) where the flash kernel cannot take the model; an explicit choice is refused."""
    auto = fit_to_model("auto", "varlen_attn", "auto: ...", head_dim)
    assert auto[0] == ("varlen_attn" if fits else "sdpa")
    if fits:
        assert fit_to_model("varlen_attn", "varlen_attn", "as set", head_dim) == ("varlen_attn", "as set")
    else:
        assert str(head_dim) in auto[1]
        with pytest.raises(KernelError, match="cannot run this model") as info:
            fit_to_model("varlen_attn", "varlen_attn", "as set", head_dim)
        assert str(head_dim) in str(info.value) and info.value.hint
    assert fit_to_model("auto", "sdpa", "why", 60) == ("sdpa", "why")  # only varlen_attn is checked


def test_explicit_attention_is_kept_or_refused_with_a_reason():
    assert resolve_attention("eager", True, CPU)[0] == "eager"
    with pytest.raises(KernelError, match="needs a CUDA GPU"):
        resolve_attention("flash_attention_2", True, CPU)
    with pytest.raises(KernelError, match="needs the flash_attn package") as info:
        resolve_attention("flash_attention_2", True, GPU)
    assert isinstance(info.value, SwiftSlurmError) and info.value.hint


@pytest.mark.parametrize("node,stage,expected", [
    (CPU, 2, "off"), (GPU, 2, "off"), (GPU_ALL, 2, "rope+rms_norm+swiglu"), (GPU_ALL, 3, "off"),
    (NodeFacts(cuda=False, liger=True), 2, "off"),
])
def test_auto_liger(node, stage, expected):
    """auto: on a GPU with liger-kernel (not ZeRO-3), the kernels that fuse the model's elementwise work, never the fused
    loss (on an H200 it halved memory but cost 12-23% of packed throughput: docs/benchmarks.md)."""
    config, why = resolve_liger("auto", stage, node)
    assert liger_names(config) == expected and why.startswith("auto")
    if config is not None:
        assert not config["fused_linear_cross_entropy"] and not config["cross_entropy"]
    assert liger_names(resolve_liger(True, 2, GPU_ALL)[0]) == "all"  # asked for where it can work: all of Liger


def test_auto_liger_is_off_with_compile_and_true_with_compile_is_refused_at_validate():
    """On an H200 torch.compile failed inside Liger's RMSNorm before the first step (docs/benchmarks.md, issue 34)."""
    config, why = resolve_liger("auto", 2, GPU_ALL, compiled=True)
    assert config is None and "train.compile" in why
    from swiftslurm.errors import SpecError
    from swiftslurm.spec import validate_spec

    train = {"model": "tiny-llama", "dataset": ["x.jsonl"], "dataset_scan": False, "compile": True}
    assert validate_spec({"train": {**train, "use_liger_kernel": "auto"}}).train.compile
    with pytest.raises(SpecError, match="compile = true with use_liger_kernel = true"):
        validate_spec({"train": {**train, "use_liger_kernel": True}})


@pytest.mark.parametrize("node,stage,what", [
    (GPU, 2, "liger-kernel is not installed"), (CPU, 2, "liger-kernel is not installed"),
    (NodeFacts(cuda=False, liger=True), 2, "needs a CUDA GPU"), (GPU_ALL, 3, "does not work under ZeRO-3"),
])
def test_liger_true_where_it_cannot_run_is_one_clear_error(node, stage, what):
    with pytest.raises(KernelError, match=what):
        resolve_liger(True, stage, node)
    assert resolve_liger(False, stage, node)[0] is None


def spec_with(**train):
    return {"job": {"name": "k"}, "train": {"model": "tiny-llama", "dataset": ["d.jsonl"], **train}}


@pytest.mark.parametrize("train,words", [
    ({"packing": False, "bf16": True}, "packing is off"),
    ({"task": "dpo", "bf16": True}, "task = 'dpo' never packs"),
    ({}, "needs bf16 or fp16"),
])
def test_validate_refuses_varlen_where_the_spec_alone_rules_it_out(train, words):
    """What the spec alone decides is refused at validate, not at train time on a node."""
    with pytest.raises(SwiftSlurmError, match=words) as info:
        validate_spec(spec_with(attn_implementation="varlen_attn", **train))
    assert "HINT" in str(info.value) or info.value.hint
    assert validate_spec(spec_with(attn_implementation="varlen_attn", bf16=True)).train.attn_implementation == "varlen_attn"


def test_spec_defaults_and_rejections():
    t = validate_spec(spec_with()).train
    assert (t.packing, t.attn_implementation, t.use_liger_kernel) == (True, "auto", "auto")
    assert (t.dataset_num_proc, t.dataloader_num_workers, t.dataloader_pin_memory) == (1, 0, True)
    for bad in ({"attn_implementation": "flash"}, {"use_liger_kernel": "yes"}, {"dataset_num_proc": 0},
                {"dataloader_num_workers": -1}, {"packing": "true"}):
        with pytest.raises(SwiftSlurmError):
            validate_spec(spec_with(**bad))
