"""The built-in trainer on CPU with real DeepSpeed (gloo), 2 ranks, the tiny model.

Few, combined runs (each costs ~20-40 s on 2 cores, most of it imports):
  demo     the quickstart spec (zero2, full FT, 50 steps): loss halves, checkpoints verify, every
           TensorBoard metric is there with plausible values, metrics.jsonl, the rank-0 summary
  stop     same spec, rank 0 alone sees a walltime stop at step 7: every rank saves and stops; a slowed
           commit outlasts signal_grace_s = 10 and the trainer warns
  resume   from that checkpoint to step 10 (rank 1's listing stale): losses of steps 8-10 equal the demo run's
  zero3    full FT: consolidated 16-bit weights load with from_pretrained, same logits as the shards
  offload  zero2_offload + LoRA: trains, saves an adapter that loads with peft
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest
import tomllib
from conftest import exit_threads_env, sacct_rows, threads_at_exit
from runs import to_toml

from swiftslurm import checkpoint as ck
from swiftslurm.train.launch import launch

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.toml"
METRICS = ["loss", "learning_rate", "grad_norm", "step_time_s", "tokens_per_s", "samples_per_s",
           "data_wait_ratio", "comm_wait_ratio", "cpu_rss_mb", "checkpoint_save_s"]

pytestmark = pytest.mark.slow


def quickstart_spec(tmp: Path, name: str, example: Path = QUICKSTART, **train) -> tuple[str, Path]:
    """A shipped example spec (the quickstart unless ``example``) with absolute paths, its own output dir and
    train overrides."""
    data = tomllib.loads(example.read_text())
    out = tmp / name
    data["job"]["output_dir"] = str(out)
    data["train"]["dataset"] = [str(ROOT / d) for d in data["train"]["dataset"]]
    data["train"].update(train)
    data.pop("preflight", None)
    path = tmp / f"{name}.toml"
    path.write_text(to_toml(data))
    return str(path), out


def run(spec: str, out: Path, **kw) -> list[dict]:
    """Both ranks to completion; their results, rank 0's output, and the threads each rank left at exit."""
    record_dir = Path(tempfile.mkdtemp(prefix="exit-threads-", dir=out.parent))
    extra_env = {**kw.pop("extra_env", {}), **exit_threads_env(record_dir)}
    procs = launch(spec, str(out), nprocs=2, timeout_s=400, extra_env=extra_env, **kw)
    for rank, p in enumerate(procs):
        assert p.returncode == 0, f"rank {rank} failed:\n{p.stdout[-6000:]}"
    results = [json.loads((out / f"result-rank{r}.json").read_text()) for r in range(2)]
    results[0]["stdout"] = procs[0].stdout
    left = threads_at_exit(record_dir)
    for rank, result in enumerate(results):
        result["threads_at_exit"] = left.get(rank)
    return results


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def tensorboard_scalars(out: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = list((out / "runs").iterdir())
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("demo")
    spec, out = quickstart_spec(tmp, "demo", logging_steps=1)
    return run(spec, out), out, tmp


def test_demo_loss_halves_and_checkpoints_verify(demo):
    results, out, _ = demo
    assert [r["global_step"] for r in results] == [50, 50]
    assert not any(r["stopped_for_requeue"] for r in results)
    by_step = losses(out)
    assert by_step[50] < by_step[1] / 2, by_step
    assert [Path(p).name for p in results[0]["checkpoints"]] == ["checkpoint-25", "checkpoint-50"]
    for name in ("checkpoint-25", "checkpoint-50"):
        assert ck.verify(out / name).ok, ck.verify(out / name).problems
        assert ck.read_manifest(out / name).meta["hashed_on_ranks"] == 2  # rank 1 hashed its rng state and optimizer shard
    assert (out / "latest").read_text().strip().endswith("checkpoint-50")
    assert not (out / ".swiftslurm-save").exists() and not list(out.glob(".staging-*"))
    stdout = results[0]["stdout"]
    assert "training finished at step 50" in stdout and f"tensorboard --logdir {out}/runs" in stdout
    assert "tokens/s" in stdout
    from swiftslurm.train.result import read_summary

    assert read_summary(str(out)) in stdout and "loss: first" in read_summary(str(out))


def test_demo_tensorboard_has_every_metric_with_plausible_values(demo):
    _, out, _ = demo
    scalars = tensorboard_scalars(out)
    for name in METRICS:
        assert f"train/{name}" in scalars, f"train/{name} missing from {sorted(scalars)}"
    s = {name: scalars[f"train/{name}"] for name in METRICS}
    assert len(s["loss"]) == 50 and all(0 < v < 10 for v in s["loss"])
    assert all(abs(v - 3e-3) < 1e-9 for v in s["learning_rate"])  # constant schedule
    assert all(v > 0 for v in s["grad_norm"])
    assert all(0 < v < 30 for v in s["step_time_s"])
    assert all(0 < v < 1 for v in s["data_wait_ratio"])
    assert all(0 < v < 1 for v in s["comm_wait_ratio"])  # 2 ranks: ZeRO-2 reduces gradients every step
    assert all(50 < v < 20000 for v in s["cpu_rss_mb"])
    assert len(s["checkpoint_save_s"]) == 2 and all(0 < v < 60 for v in s["checkpoint_save_s"])
    # tokens/s and samples/s are counted separately from the fetched batches: their ratio must be a
    # tokens-per-example figure of the shipped data (between its shortest and longest example)
    from swiftslurm.train.data.tokens import load_dataset
    from swiftslurm.train.tinymodel import build_tokenizer

    ds = load_dataset([str(ROOT / "examples/data/alpaca_demo.jsonl")], build_tokenizer(), 128)
    lengths = [len(ex["input_ids"]) for ex in ds.examples]
    ratio = [t / n for t, n in zip(s["tokens_per_s"], s["samples_per_s"], strict=True)]
    assert all(min(lengths) <= r <= max(lengths) for r in ratio), (ratio, min(lengths), max(lengths))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum("tokens_per_s" in r for r in rows) == 50 and rows[0]["step"] == 1
    assert not [k for r in rows for k in r if k.startswith("gpu_util")]  # no GPU here: the fields are absent, no error


@pytest.fixture(scope="module")
def stopped(demo):
    _, _, tmp = demo
    spec, out = quickstart_spec(tmp, "stop", logging_steps=1)
    data = tomllib.loads(Path(spec).read_text())
    data["slurm"]["signal_grace_s"] = 10  # and a commit slowed by 3 x 4 s: the save outlasts the grace period
    Path(spec).write_text(to_toml(data))
    return run(spec, out, stop_at_step=7, extra_env={"SWIFTSLURM_CKPT_TEST_DELAY_S": "4"}), spec, out


def test_walltime_stop_saves_on_every_rank_and_stops(stopped):
    results, _, out = stopped
    assert [r["global_step"] for r in results] == [7, 7]
    assert [r["stopped_for_requeue"] for r in results] == [True, True]  # rank 1 learned it by all-reduce
    assert ck.verify(out / "checkpoint-7").ok
    assert "stopped for requeue" in results[0]["stdout"]
    saves = results[0]["save_seconds"]
    assert len(saves) == 1 and saves[0] >= 12
    record = ck.savetime.read_save(out)  # every phase measured; the advice names the value to set
    assert record["step"] == 7 and not record["fits_grace"] and record["save_s"] >= 12
    assert all(record[f"{phase}_s"] >= 0 for phase in ck.savetime.PHASES) and record["commit_s"] >= 8
    hint = f"HINT: set slurm.signal_grace_s = {ck.savetime.suggested_grace_s(record['save_s'], record['step_s'])}"
    assert "more than slurm.signal_grace_s = 10 s allows" in results[0]["stdout"] and hint in results[0]["stdout"]


def test_no_process_group_thread_outlives_a_run_that_ends_or_stops(demo, stopped):
    """Every rank leaves its process groups before exit, after the last step and after a walltime save: a gloo
    worker still running at interpreter exit can abort a rank that trained and saved fine (SIGABRT)."""
    for results in (demo[0], stopped[0]):
        assert [r["threads_at_exit"] for r in results] == [[], []]
        assert "still running after shutdown" not in results[0]["stdout"]


def test_resume_reproduces_the_uninterrupted_losses(demo, stopped):
    _, spec, out = stopped
    data = tomllib.loads(Path(spec).read_text())
    data["train"]["max_steps"] = 10  # constant lr: the first 10 steps are those of the 50-step run
    Path(spec).write_text(to_toml(data))
    assert ck.newest_verified(out, log=None) == out / "checkpoint-7"
    # as `swiftslurm run` does: the newest verified, chosen by rank 0; rank 1's listing is stale (it misses
    # checkpoint-7 and, deciding alone, would start fresh): the ranks still resume from the same step
    results = run(spec, out, resume="newest", extra_env={ck.discover.STALE_LISTING_ENV: "1"})
    assert f"every rank (2) resumes from {out / 'checkpoint-7'}" in results[0]["stdout"]
    assert results[0]["global_step"] == 10
    resumed, reference = losses(out), losses(demo[1])
    for step in (8, 9, 10):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-4), (step, resumed, reference)


def test_an_async_save_writes_the_synchronous_bytes_and_a_walltime_stop_commits_it_first(demo):
    """checkpoint.async_save: the save at step 25 is copied off the training's path and committed by a background
    thread (slowed to >= 3 s) while training goes on; the walltime stop at step 26 waits for that commit, then saves
    26. Checkpoint-25 holds the bytes the demo's synchronous save of step 25 wrote, file for file."""
    _, demo_out, tmp = demo
    spec, out = quickstart_spec(tmp, "async", logging_steps=1)
    data = tomllib.loads(Path(spec).read_text())
    data["checkpoint"]["async_save"] = True
    Path(spec).write_text(to_toml(data))
    results = run(spec, out, stop_at_step=26, extra_env={"SWIFTSLURM_CKPT_TEST_DELAY_S": "1"})
    assert [r["global_step"] for r in results] == [26, 26] and all(r["stopped_for_requeue"] for r in results)
    for name in ("checkpoint-25", "checkpoint-26"):
        assert ck.verify(out / name).ok, ck.verify(out / name).problems
    assert (out / "latest").read_text().strip().endswith("checkpoint-26") and not list(out.glob(".staging-*"))
    ours, theirs = ck.read_manifest(out / "checkpoint-25").files, ck.read_manifest(demo_out / "checkpoint-25").files
    # trainer_state.json carries the logged wall times, training_args.bin the output dir: every other file is the same
    differ = sorted(rel for rel in set(ours) | set(theirs) if ours.get(rel) != theirs.get(rel))
    assert differ == ["trainer_state.json", "training_args.bin"], differ
    assert any(rel.endswith("optim_states.pt") for rel in ours)  # DeepSpeed's shards: the files the background wrote
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    stall = next(r for r in rows if r["step"] == 25 and "checkpoint_stall_s" in r)
    done = next(r for r in rows if r.get("checkpoint_step") == 25)  # logged when the background commit finished
    assert done["checkpoint_save_s"] >= 3 > stall["checkpoint_stall_s"] and stall["checkpoint_staged_mb"] > 0, (stall, done)
    last = next(r for r in rows if r["step"] == 26 and "checkpoint_stall_s" in r)
    assert last["checkpoint_wait_s"] > 0.5 and "checkpoint_step" not in last  # the stop's save waited, then saved at once


def test_zero3_full_saves_consolidated_weights_that_load_with_same_logits(tmp_path):
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from swiftslurm.train.tinymodel import build_model

    spec, out = quickstart_spec(tmp_path, "z3", deepspeed="zero3", bf16=True, max_steps=2, save_steps=2, logging_steps=1)
    run(spec, out)
    ckpt = out / "checkpoint-2"
    assert ck.verify(ckpt).ok and (ckpt / "model.safetensors").is_file()
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:  # consolidated, 16-bit, every weight whole
        w = f.get_tensor("model.embed_tokens.weight")
    assert w.dtype == torch.bfloat16 and tuple(w.shape) == (259, 64)
    loaded = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    # the reference: the fp32 master weights from the per-rank ZeRO-3 shards, rounded to bf16 the same way
    shards = build_model(loaded.config.vocab_size, 128, seed=0)
    state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    missing, unexpected = shards.load_state_dict(state, strict=False)
    assert not unexpected and not [k for k in missing if "rotary" not in k], (missing, unexpected)
    shards = shards.to(torch.bfloat16).eval()
    ids = torch.tensor([[1, 40, 41, 42, 43, 44]])
    with torch.no_grad():
        a, b = loaded(ids).logits, shards(ids).logits
        fresh = build_model(loaded.config.vocab_size, 128, seed=42).to(torch.bfloat16).eval()(ids).logits
    # bf16 forward passes agree to rounding; the training steps moved the logits far more than that
    agree, moved = (a.float() - b.float()).abs().max().item(), (a.float() - fresh.float()).abs().max().item()
    assert agree < 4e-3 and moved > 10 * agree, (agree, moved)


def test_zero2_offload_lora_saves_an_adapter(tmp_path):
    from peft import PeftModel

    from swiftslurm.train.tinymodel import build_model

    spec, out = quickstart_spec(tmp_path, "off", deepspeed="zero2_offload", train_type="lora", max_steps=2,
                                save_steps=2, logging_steps=1, gradient_checkpointing=True, lora_dropout=0.2)
    results = run(spec, out)
    ckpt = out / "checkpoint-2"
    assert results[0]["global_step"] == 2 and ck.verify(ckpt).ok
    assert "train.fused_lora: 14 LoRA projections" in results[0]["stdout"]
    assert "gradient checkpointing on" in results[0]["stdout"]  # the model the ranks trained had it on, not only the spec
    # peft's own forward trains the same: the same losses (dropout masks included, recomputed under checkpointing)
    peft_spec, peft_out = quickstart_spec(tmp_path, "peft", deepspeed="zero2_offload", train_type="lora", max_steps=2,
                                          save_steps=2, logging_steps=1, gradient_checkpointing=True, lora_dropout=0.2,
                                          fused_lora=False)
    peft_results = run(peft_spec, peft_out)
    assert "train.fused_lora" not in peft_results[0]["stdout"]
    assert losses(out).keys() == losses(peft_out).keys() == {1, 2}
    for step_ in (1, 2):
        assert losses(out)[step_] == pytest.approx(losses(peft_out)[step_], rel=1e-3, abs=1e-4), step_
    # and the same adapter (B starts at zero, so the losses alone barely see the first update)
    from safetensors.torch import load_file

    ours, theirs = (load_file(d / "checkpoint-2" / "adapter_model.safetensors") for d in (out, peft_out))
    assert ours.keys() == theirs.keys()
    moved = max((ours[k].float() - theirs[k].float()).abs().max().item() for k in ours)
    assert moved < 1e-5, moved  # 3e-7 here; with the fused path's dropout left out it is 1.2e-2
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    base = build_model(259, 128, seed=42)
    model = PeftModel.from_pretrained(base, ckpt)
    assert any("lora_" in n for n, _ in model.named_parameters())
    cfg = json.loads((ckpt / "adapter_config.json").read_text())
    assert cfg["r"] == 16 and cfg["lora_alpha"] == 32


def test_unavailable_model_is_a_clear_error(tmp_path, monkeypatch):
    from swiftslurm.errors import SwiftSlurmError
    from swiftslurm.spec import validate_spec
    from swiftslurm.train.build import load_model_and_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = validate_spec({"train": {"model": "no-such-org/no-such-model", "dataset": ["d.jsonl"]}})
    with pytest.raises(SwiftSlurmError) as info:
        load_model_and_tokenizer(spec, cuda=False)
    assert "no-such-org/no-such-model" in info.value.what and "local directory" in info.value.hint



def test_a_model_dir_loads_without_hub_kernels(tmp_path):
    """transformers >= 5.25 kernelizes what ``from_pretrained`` loads unless told not to: layers replaced by kernels it
    downloads from the Hub (code nobody here wrote; on a GPU node without internet the load failed, benchmark run of
    2026-12-04). The trainer's model and export's base for a merge load with their own layers."""
    from types import SimpleNamespace

    from swiftslurm.export.weights import base_model
    from swiftslurm.spec import validate_spec
    from swiftslurm.train.build import load_model_and_tokenizer
    from swiftslurm.train.tinymodel import build_model, build_tokenizer

    tok = build_tokenizer()
    build_model(len(tok), 64, seed=1).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    spec = validate_spec({"train": {"model": str(tmp_path / "m"), "dataset": ["d.jsonl"]}})
    model, _ = load_model_and_tokenizer(spec, cuda=False)
    base, _ = base_model(SimpleNamespace(base_model=str(tmp_path / "m"), checkpoint=tmp_path, score_head=False, takes_images=False), log=lambda line: None)
    assert (type(model).__name__, model.use_kernels, base.use_kernels) == ("LlamaForCausalLM", False, False)


def submit_on_two_nodes(spec: str, out: Path, job_name: str, timeout_s: int = 400) -> list[str]:
    """`swiftslurm submit --wait` of ``spec`` as 2 nodes x 1 rank on the test cluster; the hosts it ran on."""
    import subprocess

    data = tomllib.loads(Path(spec).read_text())
    data["job"]["name"] = job_name
    data["slurm"] = {"partition": "debug", "nodes": 2, "tasks_per_node": 1, "time": "00:10:00", "signal_grace_s": 60}
    data["preflight"] = {"checks": []}
    Path(spec).write_text(to_toml(data))
    proc = subprocess.run([sys.executable, "-m", "swiftslurm", "submit", spec, "--executor", "slurm", "--wait"],
                          capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (job_id,) = json.loads((out / "submission.json").read_text())["submissions"][-1]["job_ids"]
    ((nodelist,),) = sacct_rows(job_id, "NodeList")
    return subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                          timeout=30).stdout.split()


@pytest.mark.slurm
def test_same_trainer_runs_under_slurm_across_two_nodes(tmp_path, slurm_cluster):
    """The quickstart trainer, 2 nodes x 1 rank (gloo over 127.0.0.N), through `swiftslurm submit`."""
    spec, out = quickstart_spec(tmp_path, "slurm2", max_steps=8, save_steps=4, logging_steps=1)
    hosts = submit_on_two_nodes(spec, out, "train-2node-test")
    assert len(set(hosts)) == 2, hosts
    for name in ("checkpoint-4", "checkpoint-8"):
        assert ck.verify(out / name).ok
    by_step = losses(out)
    assert sorted(by_step) == list(range(1, 9)) and by_step[8] < by_step[1]
    assert (out / "runs").is_dir()
