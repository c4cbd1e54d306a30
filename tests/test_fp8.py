"""train.fp8 (issue 53): which layers convert, where FP8 can run, what validate refuses, and the frozen weight's
backward. Fast: no cluster, no trainer (the trainer's FP8 runs, emulated on the CPU, are in test_one_process_runs.py).
"""

from __future__ import annotations

import copy

import pytest
from test_validate_nodes import TRAINER, refused, tmp_cwd  # noqa: F401 -- tmp_cwd is a fixture

from swiftslurm.train.kernels import fp8
from swiftslurm.train.kernels.choose import KernelError

H100, A100 = (9, 0), (8, 0)


@pytest.mark.parametrize("fqn,out_f,in_f,recipe,converts", [
    ("model.layers.0.mlp.down_proj", 4096, 14336, "tensorwise", True),  # Llama-3-8B's projections
    ("model.layers.0.self_attn.k_proj", 1024, 4096, "tensorwise", False),  # in <= 4096 and out <= 1024: casts cost more
    ("model.layers.0.self_attn.q_proj", 1536, 1536, "tensorwise", True),  # a 1.5B's
    ("model.layers.0.self_attn.q_proj", 1536, 1536, "rowwise", False),  # rowwise wants out > 2048 and in > 1024
    ("model.layers.0.mlp.up_proj", 14336, 4096, "rowwise", True),
    ("model.layers.0.mlp.up_proj", 14336, 4100, "tensorwise", False),  # not a multiple of 16
    ("lm_head", 128256, 4096, "tensorwise", False),  # the loss reads it at full precision
    ("model.layers.0.mlp.gate", 128, 4096, "tensorwise", False),  # an MoE router
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default", 16, 4096, "tensorwise", False),  # adapters stay bf16
    ("model.visual.blocks.0.mlp.fc1", 5120, 1280, "tensorwise", False),  # a vision tower
])
def test_large_projections_convert_and_heads_routers_adapters_and_small_layers_do_not(fqn, out_f, in_f, recipe, converts):
    assert fp8.eligible(fqn, out_f, in_f, recipe) is converts


def test_fp8_runs_only_where_asked_on_a_gpu_with_fp8_tensor_cores(monkeypatch):
    monkeypatch.delenv(fp8.EMULATE_ENV, raising=False)
    assert fp8.resolve(False, True, H100, True)[0] is False
    on, why = fp8.resolve("auto", True, H100, True)
    assert on is False and why.startswith("auto: off")  # off until the benchmark shows a gain
    assert fp8.resolve(True, True, H100, True) == (True, "on in the spec")
    assert fp8.resolve(True, True, (8, 9), True)[0] is True  # Ada
    for cuda, capability, torchao, words in [(False, None, True, "needs a CUDA GPU"), (True, A100, True, "compute capability 8.0"),
                                             (True, H100, False, "needs torchao")]:
        with pytest.raises(KernelError) as exc:
            fp8.resolve(True, cuda, capability, torchao)
        assert words in exc.value.message(), exc.value.message()


@pytest.mark.parametrize("slurm,train,found", [
    ("", "fp8 = true\nbf16 = true", "slurm.gpus_per_node = 0"),  # a CPU job
    ("gpus_per_node = 2", "fp8 = true\nfp16 = true", "fp16 = true"),
    ("gpus_per_node = 2", "fp8 = true\nbf16 = true\nuse_liger_kernel = true", "use_liger_kernel = true"),
], ids=["cpu-job", "fp16", "liger"])
def test_fp8_that_the_nodes_would_refuse_is_refused_at_validate(tmp_cwd, slurm, train, found):  # noqa: F811
    text = TRAINER.format(model="tiny-llama", slurm=slurm, train=train, tail="")
    refused(tmp_cwd, text, "train.fp8", found)


def test_a_frozen_weight_gets_torchaos_input_gradient_without_computing_its_own(monkeypatch):
    monkeypatch.setenv(fp8.EMULATE_ENV, "1")
    import torch

    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    trained, frozen = copy.deepcopy(layers), copy.deepcopy(layers)
    assert fp8.convert(trained, "tensorwise") == fp8.convert(frozen, "tensorwise") == 2
    frozen.requires_grad_(False)
    x1 = torch.randn(4, 8, 64, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    y1, y2 = trained(x1), frozen(x2)
    assert torch.equal(y1, y2)
    grad = torch.randn_like(y1)
    y1.backward(grad)
    y2.backward(grad)
    assert torch.equal(x1.grad, x2.grad)  # torchao's own grad_input, bit for bit
    assert trained[0].weight.grad is not None and frozen[0].weight.grad is None
    x3 = x1.detach().clone().requires_grad_(True)
    layers(x3).backward(grad)  # and FP8 is really in the way: not fp32's gradient, but near it
    assert not torch.equal(x3.grad, x1.grad) and (x3.grad - x1.grad).norm() / x3.grad.norm() < 0.2
    assert trained.state_dict().keys() == layers.state_dict().keys()
