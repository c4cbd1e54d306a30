"""train/overflow.py on a real DeepSpeed ZeRO-2 bf16 engine (CPU, gloo, one rank, in a child process).

With the skip moved onto the device, a NaN gradient must still leave every weight, moment and Adam step count as
it was, a finite step must still update them, and DeepSpeed's own check (its per-parameter scan and host test)
must not run. Where the device cannot skip (no fused AdamW), where the user asked DeepSpeed to apply non-finite
steps, and outside ZeRO-1/2 bf16, nothing is changed. The trainer takes DeepSpeed's gradient norm as the engine
holds it (no host read per step)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import deepspeed  # noqa: F401  (the train extra; a missing one fails)
import pytest

from swiftslurm.train.launch import free_port  # noqa: E402

CHILD = r'''
import json, sys, torch, deepspeed
from swiftslurm.train.kernels.overflow import kept_reason, skip_nonfinite_on_device

class Wrapper:  # what Accelerate hands the Trainer's callbacks: DeepSpeed's optimizer as .optimizer
    def __init__(self, optimizer):
        self.optimizer = optimizer

def engine(bf16=True, check=True, clip=1.0, compute_norm=True, fused=True, model=None, accum=1, **zero):
    """A one-rank ZeRO engine (ZeRO-2, contiguous gradients unless ``zero`` says otherwise) over ``model`` (else a
    two-layer one, seeded)."""
    torch.manual_seed(0)
    model = model or torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    if bf16:
        model = model.to(torch.bfloat16)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accum, "gradient_clipping": clip,
           "bf16": {"enabled": bf16, "check_grad_overflow": check}, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": False,
                                 "compute_grad_norm": compute_norm, **zero}}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    eng, zopt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return eng, zopt

def steps(eng, zopt):
    calls = {"scan": 0, "host_norm_test": 0}
    real_scan = zopt.has_overflow_partitioned_grads_serial
    def scan():
        calls["scan"] += 1
        return real_scan()
    zopt.has_overflow_partitioned_grads_serial = scan
    import deepspeed.runtime.zero.stage_1_and_2 as s12
    real_test = s12.is_invalid_grad_norm
    def host_test(norm):
        calls["host_norm_test"] += 1
        return real_test(norm)
    s12.is_invalid_grad_norm = host_test
    x = torch.randn(2, 8, dtype=next(eng.module.parameters()).dtype)
    out = []
    for scale in (1.0, float("nan"), 1000.0, float("inf")):  # the third is clipped (gradient_clipping 1.0)
        before = [p.detach().clone() for p in eng.module.parameters()]
        master = zopt.single_partition_of_fp32_groups[0].detach().clone()
        eng.backward((eng(x).float().pow(2).mean() * scale))
        eng.step()
        after = list(eng.module.parameters())
        state = zopt.optimizer.state[zopt.single_partition_of_fp32_groups[0]]
        out.append({"changed": any(not torch.equal(a, b) for a, b in zip(before, after)),
                    "master_changed": not torch.equal(master, zopt.single_partition_of_fp32_groups[0]),
                    "nan": any(bool(torch.isnan(p).any()) for p in after)
                           or bool(torch.isnan(zopt.single_partition_of_fp32_groups[0]).any())
                           or bool(torch.isnan(state["exp_avg"]).any()),
                    "adam_step": float(state["step"]),
                    "master": zopt.single_partition_of_fp32_groups[0].detach().double().sum().item()})
    s12.is_invalid_grad_norm = real_test
    return {"steps": out, **calls}

def run(case):
  if case == "bf16":
    eng, zopt = engine()
    applied = skip_nonfinite_on_device(Wrapper(zopt))
    return {"applied": applied, "again": skip_nonfinite_on_device(zopt), "kept": kept_reason(Wrapper(zopt)),
            "clip_on_device": getattr(zopt, "_swiftslurm_clip_on_device", False), **steps(eng, zopt)}
  if case == "bf16_untouched":
    eng, zopt = engine()
    return {"applied": False, **steps(eng, zopt)}
  if case == "not_fused":
    eng, zopt = engine(fused=False)
    return {"applied": skip_nonfinite_on_device(Wrapper(zopt)), "kept": kept_reason(Wrapper(zopt)), **steps(eng, zopt)}
  if case == "check_off":
    eng, zopt = engine(check=False)
    return {"applied": skip_nonfinite_on_device(Wrapper(zopt)), "kept": kept_reason(Wrapper(zopt)), **steps(eng, zopt)}
  if case == "no_norm":
    eng, zopt = engine(clip=0.0, compute_norm=False)
    return {"applied": skip_nonfinite_on_device(Wrapper(zopt)), "kept": kept_reason(Wrapper(zopt))}
  if case == "fp32":
    eng, zopt = engine(bf16=False)
    return {"applied": skip_nonfinite_on_device(Wrapper(zopt)), "torch_optimizer": skip_nonfinite_on_device(zopt.optimizer),
            "kept": kept_reason(Wrapper(zopt))}

def run_grad_norm():
    """The Trainer's grad norm under DeepSpeed: what our trainer hands its loop, against Accelerate's wrapper."""
    from types import SimpleNamespace
    from accelerate.utils.deepspeed import DeepSpeedEngineWrapper
    from swiftslurm.train.trainer import SwiftTrainer
    eng, zopt = engine()
    eng.backward(eng(torch.randn(2, 8, dtype=torch.bfloat16)).float().pow(2).mean())
    eng.step()
    wrapped = DeepSpeedEngineWrapper(eng)
    trainer = object.__new__(SwiftTrainer)  # only the two grad-norm methods are called
    trainer.is_deepspeed_enabled = True
    trainer.accelerator = SimpleNamespace(deepspeed_engine_wrapped=wrapped)
    norm = trainer._get_grad_norm(eng, trainer._clip_grad_norm(eng))
    held = eng.get_global_grad_norm()
    return {"ours": type(norm).__name__, "held": norm is held, "value": float(norm),
            "accelerate": type(wrapped.get_global_grad_norm()).__name__, "accelerate_value": wrapped.get_global_grad_norm()}

def run_wrapped(opaque):
    import functools
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Z
    real = Z.step
    def wrapper(self, *a, **k):
        return real(self, *a, **k)
    Z.step = wrapper if opaque else functools.wraps(real)(wrapper)
    try:
        eng, zopt = engine()
        return {"applied": skip_nonfinite_on_device(Wrapper(zopt)), "kept": kept_reason(Wrapper(zopt))}
    finally:
        Z.step = real

def run_norm(case):
    """The gradient norm of norm_in_one_pass against DeepSpeed's own, step by step on two engines from one seed (one
    step clipped, then a NaN and an inf one); 'opaque': a get_grad_norm_direct whose source cannot be read is left alone."""
    import functools
    from swiftslurm.train.kernels.overflow import norm_in_one_pass
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Z
    if case == "norm_opaque":
        real = Z.get_grad_norm_direct
        Z.get_grad_norm_direct = lambda self, *a, **k: real(self, *a, **k)
        try:
            eng, zopt = engine()
            return {"applied": norm_in_one_pass(Wrapper(zopt))}
        finally:
            Z.get_grad_norm_direct = real
    out = {}
    for arm in ("deepspeed", "ours"):
        eng, zopt = engine(check=False)
        applied = norm_in_one_pass(Wrapper(zopt)) if arm == "ours" else False
        casts = {"vector_norm": 0}
        real_norm = torch.linalg.vector_norm
        def counting(*a, **k):
            casts["vector_norm"] += 1
            return real_norm(*a, **k)
        torch.linalg.vector_norm = counting
        norms, masters = [], []
        x = torch.randn(2, 8, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
        for scale in (1.0, 1000.0, 3.0, float("nan"), float("inf")):
            eng.backward(eng(x).float().pow(2).mean() * scale)
            eng.step()
            norms.append(float(eng.get_global_grad_norm()))
            masters.append(zopt.single_partition_of_fp32_groups[0].detach().double().tolist())
        torch.linalg.vector_norm = real_norm
        out[arm] = {"applied": applied, "again": norm_in_one_pass(zopt) if arm == "ours" else None, "norms": norms,
                    "masters": masters, **casts}
    return out

def run_contig():
    """One rank, ZeRO-1 and ZeRO-2 bf16, gradient accumulation 2, 3 steps: contiguous_gradients true and false (the
    one-rank default of dsconfig.one_rank) give the same master weights, losses and norms."""
    out = {}
    for stage, contig in ((2, True), (2, False), (1, True), (1, False)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8), torch.nn.Linear(8, 1))
        eng, zopt = engine(model=model, accum=2, stage=stage, contiguous_gradients=contig,
                           reduce_bucket_size=200)  # several buckets in one backward
        skip_nonfinite_on_device(Wrapper(zopt))
        start = [g.detach().double().tolist() for g in zopt.single_partition_of_fp32_groups]
        gen = torch.Generator().manual_seed(1)
        losses, norms = [], []
        for _ in range(6):
            loss = eng(torch.randn(2, 8, dtype=torch.bfloat16, generator=gen)).float().pow(2).mean()
            eng.backward(loss)
            eng.step()
            losses.append(loss.item())
            norms.append(float(eng.get_global_grad_norm() or 0.0))
        out[f"{stage} {contig}"] = {"masters": [g.detach().double().tolist() for g in zopt.single_partition_of_fp32_groups],
                            "start": start, "losses": losses, "norms": norms, "contiguous": zopt.contiguous_gradients}
    return out

print("RESULT " + json.dumps({case: run_wrapped(case == "opaque") if case in ("wrapped", "opaque")
                             else run_contig() if case == "contig"
                             else run_norm(case) if case.startswith("norm") else run_grad_norm() if case == "grad_norm"
                             else run(case) for case in sys.argv[1:]}))
'''
CASES = ["bf16", "bf16_untouched", "not_fused", "check_off", "no_norm", "fp32", "wrapped", "opaque", "grad_norm", "norm",
         "norm_opaque", "contig"]
SKIPPED = {"changed": False, "master_changed": False, "nan": False}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """Every case's engine, built one after another in one child process (one DeepSpeed start-up)."""
    tmp_path = tmp_path_factory.mktemp("overflow")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "LOCAL_RANK": "0",
           "WORLD_SIZE": "1", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", CHILD, *CASES], capture_output=True, text=True, env=env, timeout=300,
                          cwd=tmp_path)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def without_step(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("adam_step", "master")}


def test_a_nonfinite_step_is_skipped_on_the_device_and_finite_ones_applied(results):
    res = results["bf16"]
    assert res["applied"] is True and res["again"] is True and res["kept"] is None
    finite, nan, finite_again, inf = res["steps"]
    assert finite["changed"] and finite["master_changed"] and not finite["nan"]
    assert without_step(nan) == SKIPPED and without_step(inf) == SKIPPED  # weights, master copy, moments untouched
    assert finite_again["changed"] and not finite_again["nan"]
    assert [s["adam_step"] for s in res["steps"]] == [1.0, 1.0, 2.0, 2.0]  # a skipped step does not count
    # DeepSpeed's check never ran (no scan), and its clipping did not test the norm on the host either
    assert res["scan"] == 0 and res["host_norm_test"] == 0 and res["clip_on_device"] is True


def test_deepspeed_left_alone_checks_on_the_host_with_the_same_outcome(results):
    res = results["bf16_untouched"]
    assert [s["changed"] for s in res["steps"]] == [True, False, True, False] and not any(s["nan"] for s in res["steps"])
    assert res["scan"] == 4 and res["host_norm_test"] >= 4  # every step, finite or not
    # the same master weights after every step, the clipped third one included: the clipping's arithmetic is DeepSpeed's
    assert [s["master"] for s in results["bf16"]["steps"]] == [s["master"] for s in res["steps"]]


def test_without_fused_adamw_deepspeed_keeps_its_check(results):
    res = results["not_fused"]
    assert res["applied"] is False
    # the rank-0 line says why the check stays (trainer.py logs it)
    assert res["kept"] == "the torch optimizer is AdamW (fused=False), not a fused torch Adam/AdamW"
    assert [s["changed"] for s in res["steps"]] == [True, False, True, False] and res["scan"] == 4


def test_a_user_who_turned_the_check_off_gets_deepspeeds_behaviour(results):
    """``check_grad_overflow = false``: DeepSpeed applies the NaN step; swiftslurm leaves that choice alone."""
    res = results["check_off"]
    assert res["applied"] is False and res["kept"] is None  # nothing to say: the user chose it
    assert res["steps"][1]["nan"] is True


@pytest.mark.parametrize("case", ["no_norm", "fp32"])
def test_other_configurations_are_left_alone(case, results):
    res = results[case]
    assert res["applied"] is False and res.get("torch_optimizer", False) is False


def test_why_the_check_stays_is_said_only_where_it_was_wanted(results):
    """bf16 ZeRO-1/2 with the check on but no norm: a reason; fp32 (no bf16 check at all): none."""
    assert results["no_norm"]["kept"] == "zero_optimization.compute_grad_norm is off"
    assert results["fp32"]["kept"] is None


def test_a_wrapped_deepspeed_step_is_read_through_its_wrapper(results):
    """A profiler or probe that wraps DeepSpeed's ``step`` with functools.wraps (benchmarks/gpu/probe) keeps the
    skip: the source check follows ``__wrapped__``; a wrapper that hides the code makes it refuse, with a reason."""
    assert results["wrapped"] == {"applied": True, "kept": None}
    assert results["opaque"]["applied"] is False
    assert "no longer has the shape" in results["opaque"]["kept"]


def test_the_grad_norm_stays_on_the_device_until_a_logging_step(results):
    """Accelerate's wrapper reads DeepSpeed's norm on the host (``.item()``: a GPU sync every step); the trainer
    hands its loop the engine's own tensor, which the Trainer reads only when it logs. Same value."""
    row = results["grad_norm"]
    assert row["accelerate"] == "float" and row["ours"] == "Tensor" and row["held"], row
    assert row["value"] == row["accelerate_value"] > 0


def test_the_gradient_norm_in_one_pass_is_deepspeeds_norm(results):
    """norm_in_one_pass: no per-gradient vector_norm (one a step is left, on the combined norm); the norms (one step clipped by gradient_clipping 1.0) and the
    master weights after each step equal DeepSpeed's own to fp32 rounding; idempotent; an unreadable method is kept."""
    ds, ours = results["norm"]["deepspeed"], results["norm"]["ours"]
    assert ours["applied"] is True and ours["again"] is True
    assert ds["vector_norm"] - ours["vector_norm"] == 5 * 4  # four gradients a step, five steps: none left per gradient
    assert ds["norms"][1] > 1.0  # the clipped step: its norm decides the clip factor
    assert ours["norms"] == pytest.approx(ds["norms"], rel=1e-6)
    assert ds["norms"][3:] == [float("inf")] * 2  # a NaN and an inf gradient: masked to -1, which DeepSpeed reports as inf
    for a, b in zip(ours["masters"][:3], ds["masters"][:3], strict=True):  # the NaN step is applied (check off)
        assert a == pytest.approx(b, rel=1e-5, abs=1e-7)
    assert results["norm_opaque"]["applied"] is False


def test_one_rank_without_contiguous_gradients_trains_the_same(results):
    """dsconfig.one_rank turns contiguous_gradients off on one rank: with gradient accumulation and several reduce
    buckets a ZeRO-1 and a ZeRO-2 engine must still take the same steps (the same masters, bit for bit, the same losses and norms)."""
    for stage in (1, 2):
        on, off = results["contig"][f"{stage} True"], results["contig"][f"{stage} False"]
        assert (on["contiguous"], off["contiguous"]) == (True, False)
        assert off["losses"] == on["losses"] and off["norms"] == on["norms"], stage
        assert off["masters"] == on["masters"], stage
        assert on["masters"] != on["start"] and len(set(on["losses"])) == 6  # it trained: three steps moved the weights
