"""Mixture-of-experts models (issue 55), beyond sizing (tests/test_moe_sizing.py) and the one-process LoRA run
(tests/test_one_process_runs.py): the tiny MoE stopped at walltime on two nodes resumes to the losses of an
uninterrupted run, with its router's balance in metrics.jsonl and `status`; `doctor` names a collapsed router."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from test_doctor import write_metrics

from swiftslurm.doctor import diagnose_task
from swiftslurm.doctor.evidence import read_task

ROOT = Path(__file__).resolve().parents[1]


def router_rows(loads: list[float], limit: float = 2.0) -> list[dict]:
    return [{"step": i + 1, "time": 1000.0 + i, "loss": 2.0, "grad_norm": 1.0, "router_load_max": v, "router_load_limit": limit}
            for i, v in enumerate(loads)]


@pytest.mark.parametrize("loads,found", [([1.2, 1.9, 1.95, 2.0], True), ([1.9, 1.95, 2.0, 1.3], False),
                                         ([1.2, 1.3, 1.5, 1.55], False)])
def test_doctor_names_a_router_that_sent_nearly_every_token_to_the_same_experts(tmp_path, loads, found):
    write_metrics(tmp_path, router_rows(loads))  # 4 experts, top-2: the ceiling is 2.0, collapsed at 0.8 of it
    findings = [f for f in diagnose_task(read_task(0, str(tmp_path))) if f.code == "router_collapse"]
    assert bool(findings) is found, findings
    if found:
        (f,) = findings
        assert "train.router_aux_loss_coef" in f.keys and "max/mean 2.00 of at most 2" in f.what, f
        assert [e.step for e in f.evidence] == [2, 4]


@pytest.mark.parametrize("lora", ['lora_dropout = 0.05', 'lora_target_modules = ["q_proj", "down_proj"]', 'lora_dropout = 0.0'])
def test_lora_dropout_goes_to_the_projections_and_not_to_the_expert_weights_peft_adapts_as_parameters(tmp_path, lora):
    from swiftslurm.spec import parse_toml, validate_spec
    from swiftslurm.train.build import _apply_lora
    from swiftslurm.train.tinymodel import build_model

    out = tmp_path / "out"
    spec = tmp_path / "moe.toml"
    spec.write_text(f'[job]\nname = "moe"\noutput_dir = "{out}"\n[slurm]\ntasks_per_node = 2\n[train]\nmodel = "tiny-moe"\n'
                    f'dataset = ["{ROOT / "examples/data/alpaca_demo.jsonl"}"]\ntrain_type = "lora"\n{lora}\n')
    run = subprocess.run(["swiftslurm", "validate", str(spec)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and not out.exists(), run.stdout + run.stderr  # peft's refusal no longer reaches the nodes
    train = validate_spec(parse_toml(spec.read_text())).train
    model = _apply_lora(build_model(260, 128, 0, name="tiny-moe"), train)
    drops = {name.rsplit(".lora_dropout", 1)[0]: type(m).__name__ for name, m in model.named_modules() if name.endswith("lora_dropout.default")}
    projections = {k: v for k, v in drops.items() if k.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))}
    assert projections and set(projections.values()) == {"Dropout" if train.lora_dropout else "Identity"}, drops
    dropped = [m.p for m in model.modules() if type(m).__name__ == "Dropout"]
    assert all(p == train.lora_dropout for p in dropped)
    wrappers = [m for m in model.modules() if type(m).__name__ == "ParamWrapper"]
    assert wrappers and all(type(w.lora_dropout["default"]).__name__ == "Identity" for w in wrappers)  # the experts: none


def test_the_banner_names_liger_s_fused_experts_where_its_swiglu_will_replace_them():
    """Liger's SwiGLU patch swaps a Qwen3-MoE's experts for its fused ones after the model loads (the Trainer applies
    it): the banner says so instead of the config's grouped_mm; a model type Liger leaves its experts keeps its own."""
    from swiftslurm.train import moe
    from swiftslurm.train.tinymodel import build_model

    model = build_model(260, 128, 0, name="tiny-moe")
    assert "experts: grouped_mm" in moe.configure(model, None).banner()
    assert "experts: Liger's fused experts" in moe.configure(model, None, liger_swiglu=True).banner()
    model.config.model_type = "gpt_oss"  # Liger patches gpt-oss but keeps its experts
    assert "experts: grouped_mm" in moe.configure(model, None, liger_swiglu=True).banner()


@pytest.mark.slurm
@pytest.mark.slow
def test_a_tiny_moe_on_two_nodes_stopped_at_walltime_resumes_to_the_uninterrupted_losses(tmp_path, slurm_cluster):
    """test_resume's spec (2 nodes x 1 rank, ZeRO-2, full fine-tuning) with model = "tiny-moe", side by side with an
    uninterrupted run; the walltime signal at step 8 or later: it saves, requeues, resumes on both nodes and logs every
    step's loss bitwise as the reference did. Its router's tokens per expert are logged and shown by `status`."""
    from test_resume import requeued_beside_reference

    steps = 30
    req_out = requeued_beside_reference(tmp_path, "moe", steps, 8, train={"model": "tiny-moe"})

    rows = [json.loads(line) for line in (req_out / "metrics.jsonl").read_text().splitlines()]
    routed = [r for r in rows if "router_load_max" in r]
    assert len(routed) >= steps and all(1.0 <= r["router_load_max"] <= r["router_load_limit"] == 2.0 for r in routed)
    status = subprocess.run(["swiftslurm", "status", str(req_out)], capture_output=True, text=True, timeout=60)
    assert f"router max/mean {routed[-1]['router_load_max']:.2f}" in status.stdout, status.stdout + status.stderr
