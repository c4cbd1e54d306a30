"""Reward models (train.task = "rm") and KTO (train.task = "kto").

Fast: the spec refusals and the data checks of `swiftslurm validate` (file and line named); `plan`'s memory
estimate of each task (pure).
Slow, on the Slurm test cluster (2 nodes x 1 CPU rank each, the tiny model, LoRA under ZeRO-2, real TRL/DeepSpeed):
  rm   the shipped example, stopped by a USR2 (what Slurm sends before the walltime) mid-run: it saves, requeues
       itself, resumes and finishes with every loss of an uninterrupted run of the same spec; the accuracy and margin
       reach metrics.jsonl, TensorBoard and the summary; the checkpoints verify and the adapter holds the score head
  kto  the shipped example: the rewards and KL reach metrics.jsonl, the summary names the margin, checkpoints verify
(The rm accuracy on the separable demo pairs, full fine-tuning under ZeRO-3: tests/test_one_process_runs.py.)
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomllib
from conftest import sacct_rows, wait_for_job
from runs import losses, metrics, submit
from test_train import quickstart_spec, to_toml

ROOT = Path(__file__).resolve().parents[1]
RM_EXAMPLE = ROOT / "examples" / "rm_lora.toml"
KTO_EXAMPLE = ROOT / "examples" / "kto_lora.toml"


def validate(spec: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swiftslurm", "validate", spec], capture_output=True, text=True, timeout=120)


def flat(r: subprocess.CompletedProcess) -> str:
    return " ".join((r.stdout + r.stderr).split())


# ---------------------------------------------------------------- fast: refusals and data checks


@pytest.mark.parametrize("example, train, expected", [
    (KTO_EXAMPLE, {"per_device_train_batch_size": 1}, ["needs per_device_train_batch_size >= 2", "KL term"]),
    (KTO_EXAMPLE, {"dpo_loss_type": "ipo"}, ['dpo_loss_type set with task = "kto"']),
    (KTO_EXAMPLE, {"use_liger_kernel": True}, ['use_liger_kernel = true with task = "kto"']),
    (RM_EXAMPLE, {"dpo_beta": 0.5, "max_prompt_length": 32}, ['dpo_beta, max_prompt_length set with task = "rm"']),
    (RM_EXAMPLE, {"kto_desirable_weight": 2.0}, ['kto_desirable_weight set with task = "rm"']),
    (RM_EXAMPLE, {"resume_from": "/nonexistent/checkpoint-4", "resume_weights_only": True}, ["1-output score head"]),
])
def test_spec_refuses_what_cannot_work_with_the_reason(tmp_path, example, train, expected):
    spec, _ = quickstart_spec(tmp_path, "bad", example=example, **train)
    r = validate(spec)
    assert r.returncode == 2, r.stdout + r.stderr
    for piece in expected:
        assert piece in flat(r), flat(r)
    assert "Traceback" not in r.stderr


def with_data(tmp_path: Path, example: Path, records: list[str]) -> tuple[str, Path]:
    data = tmp_path / "records.jsonl"
    data.write_text("\n".join(records) + "\n")
    spec, _ = quickstart_spec(tmp_path, "data", example=example, dataset=[str(data)])
    return spec, data


@pytest.mark.parametrize("example, records, where, what", [
    (RM_EXAMPLE, ['{"prompt": "a", "chosen": "b", "rejected": "c"}', '{"prompt": "a", "completion": "b", "label": true}'],
     "line 2", "missing 'chosen', 'rejected'"),
    (KTO_EXAMPLE, ['{"prompt": "a", "completion": "b", "label": true}', '{"prompt": "a", "chosen": "b", "rejected": "c"}'],
     "line 2", "missing 'completion', 'label' (a chosen/rejected pair is task = \"dpo\" or \"rm\" data)"),
    (KTO_EXAMPLE, ['{"prompt": "a", "completion": "b", "label": true}', '', '{"prompt": "a", "completion": "c", "label": "no"}'],
     "line 3", "'label' must be true (desirable) or false (undesirable)"),
    (KTO_EXAMPLE, ['{"prompt": "a", "completion": "", "label": true}'], "line 1", "'completion' is empty"),
    (KTO_EXAMPLE, ['{"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "user", "content": "b"}], "label": true}'],
     "line 1", "assistant messages only"),
    (KTO_EXAMPLE, ['{"prompt": "a", "completion": "b", "label": true}',
                   '{"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "assistant", "content": "b"}], "label": false}'],
     "line 2", "one dataset holds one form"),
])
def test_wrong_columns_are_refused_at_validate_naming_file_and_line(tmp_path, example, records, where, what):
    spec, data = with_data(tmp_path, example, records)
    r = validate(spec)
    assert r.returncode == 2 and f"{data}, {where}: " in flat(r) and what in flat(r), flat(r)
    assert "Traceback" not in r.stderr


def test_kto_data_with_one_label_only_is_refused(tmp_path):
    spec, _ = with_data(tmp_path, KTO_EXAMPLE, ['{"prompt": "a", "completion": "b", "label": true}',
                                                '{"prompt": "c", "completion": "d", "label": true}'])
    r = validate(spec)
    assert r.returncode == 2 and "every KTO record has label = true" in flat(r), flat(r)


def test_the_examples_validate_with_their_record_counts():
    for example, note in ((RM_EXAMPLE, "64 preference pair(s)"), (KTO_EXAMPLE, "96 labelled completion(s)")):
        r = subprocess.run([sys.executable, "-m", "swiftslurm", "validate", str(example)], capture_output=True, text=True,
                           timeout=120, cwd=ROOT)
        assert r.returncode == 0 and note in r.stdout, r.stdout + r.stderr


def test_memory_estimate_of_each_task():
    """rm: no LM head or vocabulary logits, two sequences per pair, the score head trainable under LoRA;
    kto: a frozen reference copy with full fine-tuning (sharded by ZeRO-3), none with LoRA or precomputed log-probs."""
    from dataclasses import replace

    from swiftslurm.sizing.layout import Layout
    from swiftslurm.sizing.memory import Settings, estimate
    from swiftslurm.sizing.shape import ModelShape

    shape = ModelShape(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336,
                       vocab_size=128256, tie_word_embeddings=False, source="8B")
    layout = Layout(8, 1, 1, 2, 1)  # world, sp, tp, micro-batch, grad accumulation
    full = Settings(3, False, False, "full", 8, "all-linear", True, True, 2048, 80.0, 8)
    sft, rm = estimate(shape, full, layout), estimate(shape, replace(full, task="rm"), layout)
    assert rm.total_params == sft.total_params - shape.vocab_size * shape.hidden_size + shape.hidden_size
    assert rm.parts["activations"] > 1.9 * sft.parts["activations"]  # chosen and rejected of each pair
    assert rm.parts["logits_loss"] < sft.parts["logits_loss"] / 1000
    lora = replace(full, train_type="lora")
    assert estimate(shape, replace(lora, task="rm"), layout).trainable_params == estimate(shape, lora, layout).trainable_params + shape.hidden_size

    kto = estimate(shape, replace(full, task="kto", reference_copy=True), layout)
    assert kto.parts["reference"] == 2 * sft.total_params // 8 and kto.total_bytes > sft.total_bytes
    assert "reference" not in sft.parts

    from swiftslurm.sizing.tasks import holds_reference_copy

    assert holds_reference_copy("kto", "full", False)
    assert not holds_reference_copy("kto", "lora", False) and not holds_reference_copy("kto", "full", True)


def test_plan_counts_the_kto_reference_copy(tmp_path):
    def plan_json(**train) -> dict:
        spec, _ = quickstart_spec(tmp_path, "plan", example=KTO_EXAMPLE, **train)
        r = subprocess.run([sys.executable, "-m", "swiftslurm", "plan", spec, "--json"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        return json.loads(r.stdout)

    full = json.dumps(plan_json(train_type="full"))
    assert '"reference"' in full
    assert '"reference"' not in json.dumps(plan_json(train_type="full", precompute_ref_log_probs=True))


# ---------------------------------------------------------------- slow: on the Slurm cluster

RM_STEPS, RM_STOP_AFTER, MIN_STEP_S = 24, 8, 0.5


def cluster_spec(tmp: Path, name: str, example: Path, min_step_s: float = 0.0, **train) -> tuple[Path, Path]:
    """The example as 2 nodes x 1 rank on the test cluster, its own output dir, no preflight."""
    spec, out = quickstart_spec(tmp, name, example=example, **train)
    data = tomllib.loads(Path(spec).read_text())
    data["job"]["name"] = f"reward-tasks-{name}"
    data["slurm"] = {"partition": "debug", "nodes": 2, "tasks_per_node": 1, "time": "00:10:00", "signal_grace_s": 60}
    data["preflight"] = {"checks": []}
    data["env"] = {"OMP_NUM_THREADS": "1", **({"SWIFTSLURM_TEST_MIN_STEP_S": str(min_step_s)} if min_step_s else {})}
    Path(spec).write_text(to_toml(data))
    return Path(spec), out


def signal_when(out: Path, job: str, step: int, timeout_s: float) -> None:
    """USR2 to the job's ranks (what Slurm sends signal_grace_s before the time limit) once rank 0 logged ``step``."""
    deadline = time.monotonic() + timeout_s
    while max(losses(out), default=0) < step:
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job} did not reach step {step} in {timeout_s} s")
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR2", job], check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def cluster_runs(tmp_path_factory, slurm_cluster):
    """Three jobs at once: rm uninterrupted, rm stopped and requeued at step RM_STOP_AFTER, kto."""
    tmp = tmp_path_factory.mktemp("reward-tasks")
    common = dict(max_steps=RM_STEPS, save_steps=12, logging_steps=1)
    ref = cluster_spec(tmp, "rm-ref", RM_EXAMPLE, **common)
    req = cluster_spec(tmp, "rm-req", RM_EXAMPLE, min_step_s=MIN_STEP_S, **common)  # slow steps: the signal lands mid-run
    kto = cluster_spec(tmp, "kto", KTO_EXAMPLE, max_steps=8, save_steps=4, logging_steps=1)
    jobs = {name: submit(*paths) for name, paths in (("rm-req", req), ("rm-ref", ref), ("kto", kto))}
    try:
        signal_when(req[1], jobs["rm-req"], RM_STOP_AFTER, timeout_s=1500)  # a loaded machine: starts take minutes
        states = {name: wait_for_job(job, timeout_s=1500)[job] for name, job in jobs.items()}
    finally:  # never leave this test's jobs behind on the shared cluster (the name guards against reused ids)
        for name, job in jobs.items():
            subprocess.run(["scancel", f"--name=reward-tasks-{name}", job], capture_output=True, timeout=30)
    return {"states": states, "ref": ref[1], "req": req[1], "kto": kto[1], "jobs": jobs}


def tensorboard_steps(out: Path) -> dict[str, set[int]]:
    """The steps of every scalar, over every run dir (a requeued job writes one per start)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps: dict[str, set[int]] = {}
    for run_dir in (out / "runs").iterdir():
        acc = EventAccumulator(str(run_dir))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            steps.setdefault(tag, set()).update(e.step for e in acc.Scalars(tag))
    return steps


def verify(out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swiftslurm", "verify", str(out)], capture_output=True, text=True, timeout=120)


@pytest.mark.slurm
@pytest.mark.slow
def test_rm_requeued_at_a_walltime_signal_resumes_to_the_uninterrupted_losses(cluster_runs):
    from safetensors import safe_open

    from swiftslurm import checkpoint as ck

    assert cluster_runs["states"]["rm-ref"] == cluster_runs["states"]["rm-req"] == "COMPLETED", cluster_runs["states"]
    ref, req = cluster_runs["ref"], cluster_runs["req"]
    requeues = json.loads((req / "requeues.json").read_text())
    # our USR2 made the last stop (a shared cluster may add one of its own: each must have been requeued too)
    assert all(r["requeued"] for r in requeues) and RM_STOP_AFTER <= requeues[-1]["global_step"] < RM_STEPS, requeues
    whole, again = losses(ref), losses(req)
    assert sorted(whole) == sorted(again) == list(range(1, RM_STEPS + 1))
    for step, values in again.items():
        for value in values:
            assert value == pytest.approx(whole[step][0], rel=1e-5, abs=1e-6), (step, values, whole[step])
    for out in (ref, req):
        r = verify(out)
        assert r.returncode == 0 and "verified" in r.stdout, r.stdout + r.stderr
    newest = ck.newest_verified(req, log=None)
    assert newest is not None and ck.read_manifest(newest).step == RM_STEPS
    with safe_open(str(newest / "adapter_model.safetensors"), "pt") as f:  # LoRA + the whole score head (modules_to_save)
        keys = list(f.keys())
    assert any(k.endswith("score.weight") for k in keys) and any("lora_A" in k for k in keys), keys

    # the reward metrics: metrics.jsonl, TensorBoard, the summary
    accuracy = [r["accuracy"] for r in metrics(ref) if "accuracy" in r]
    margin = [r["margin"] for r in metrics(ref) if "margin" in r]
    assert len(accuracy) == len(margin) == RM_STEPS and accuracy[-1] > 0.8 and margin[-1] > margin[0], (accuracy, margin)
    scalars = tensorboard_steps(req)
    assert scalars["train/accuracy"] == scalars["train/margin"] == set(range(1, RM_STEPS + 1)), sorted(scalars)
    summary = json.loads((ref / "train-summary.json").read_text())
    assert summary["task"] == "rm" and summary["reward_accuracy"] == accuracy[-1] and summary["reward_margin"] == margin[-1]
    assert f"reward accuracy (chosen scored above rejected, last logged step): {accuracy[-1]:.3f}; margin {margin[-1]:.3f}" in summary["text"]


@pytest.mark.slurm
@pytest.mark.slow
def test_kto_trains_across_two_nodes_and_its_checkpoints_verify(cluster_runs):
    out = cluster_runs["kto"]
    assert cluster_runs["states"]["kto"] == "COMPLETED", cluster_runs["states"]
    ((hosts,),) = sacct_rows(cluster_runs["jobs"]["kto"], "NodeList")
    assert len(subprocess.run(["scontrol", "show", "hostnames", hosts], capture_output=True, text=True, timeout=30).stdout.split()) == 2
    r = verify(out)
    assert r.returncode == 0 and "checkpoint-4" in r.stdout and "checkpoint-8" in r.stdout, r.stdout + r.stderr
    logged = metrics(out)
    assert sorted(losses(out)) == list(range(1, 9))
    margins = [r["rewards/margins"] for r in logged if "rewards/margins" in r]
    assert len(margins) == 8 and all("kl" in r for r in logged if "rewards/margins" in r), logged[:2]
    summary = json.loads((out / "train-summary.json").read_text())
    assert summary["task"] == "kto" and summary["reward_margin"] == margins[-1]
    assert "reward margin (desirable minus undesirable, last logged step)" in summary["text"]
