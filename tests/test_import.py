"""Checkpoints we did not write (checkpoint/foreign.py, importer.py, `swiftslurm import`), weights-only loading
(train/weights.py) and the train.resume_from spec keys: real files (torch zip files, safetensors), no training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from swiftslurm import checkpoint as ck
from swiftslurm.checkpoint.formats.foreign import inspect_dir
from swiftslurm.checkpoint.formats.importer import ImportRefused, import_dir
from swiftslurm.errors import CheckpointDamaged, RuntimeEnvError, SpecError, SwiftSlurmError


def hf_trainer_ckpt(root: Path, step: int = 4, ranks: int = 2, stage: int = 2, bf16: bool = True) -> Path:
    """An HF Trainer + DeepSpeed checkpoint-N as transformers and DeepSpeed lay it out (small real files)."""
    ckpt = root / f"checkpoint-{step}"
    tag = ckpt / f"global_step{step}"
    tag.mkdir(parents=True)
    ds_config = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}}
    prefix = "bf16_" if bf16 else ""
    if stage == 3:
        for r in range(ranks):
            torch.save({"ds_config": ds_config, "dp_world_size": ranks}, tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
    else:
        torch.save({"module": {"w": torch.zeros(4)}, "ds_config": ds_config, "dp_world_size": ranks}, tag / "mp_rank_00_model_states.pt")
    for r in range(ranks):
        torch.save({"optimizer_state_dict": {"x": torch.ones(8)}}, tag / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        torch.save({"python": r}, ckpt / f"rng_state_{r}.pth")
    (ckpt / "latest").write_text(f"global_step{step}")
    torch.save({"last_epoch": step}, ckpt / "scheduler.pt")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step, "epoch": 0.5}))
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))
    save_file({"w": torch.zeros(4, dtype=torch.bfloat16)}, str(ckpt / "model.safetensors"))
    return ckpt


def test_an_hf_trainer_deepspeed_checkpoint_is_described_imported_and_verifies(tmp_path):
    src = hf_trainer_ckpt(tmp_path / "theirs")
    facts = inspect_dir(src)
    assert (facts.kind, facts.step, facts.world_size, facts.zero_stage, facts.dtype, facts.deepspeed, facts.weights) == \
        ("hf-trainer", 4, 2, 2, "bfloat16", True, "full")
    assert not facts.problems
    facts, final = import_dir(src, tmp_path / "ours")
    assert final == tmp_path / "ours" / "checkpoint-4" and ck.verify(final).ok
    m = ck.read_manifest(final)
    assert m.meta["source"]["kind"] == "hf-trainer" and m.meta["world_size"] == 2 and m.meta["zero_stage"] == 2
    assert sorted(m.files) == sorted(ck.manifest.walk_files(src))
    assert import_dir(src, tmp_path / "ours")[1] == final  # again: the committed copy is reused
    other = hf_trainer_ckpt(tmp_path / "other")
    with pytest.raises(ImportRefused, match="exists already"):
        import_dir(other, tmp_path / "ours")


def test_the_json_transformers_writes_is_whole_and_a_step_past_int64_is_not(tmp_path):
    """transformers saves a tokenizer with no length limit as model_max_length = int(1e30): 31 digits, beyond the
    int64 that swiftslurm's own records hold. A file of another tool's with it is whole, not damage."""
    from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

    src = hf_trainer_ckpt(tmp_path / "theirs")
    (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": VERY_LARGE_INTEGER}))
    (src / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16", "max_len": VERY_LARGE_INTEGER}))
    facts = inspect_dir(src)
    assert not facts.problems and facts.dtype == "bfloat16", facts.problems
    assert ck.verify(import_dir(src, tmp_path / "ours")[1]).ok
    huge = hf_trainer_ckpt(tmp_path / "huge", step=5)
    (huge / "trainer_state.json").write_text('{"global_step": 9223372036854775808}')
    assert inspect_dir(huge).problems == ["trainer_state.json: no global_step (ValueError: 9223372036854775808 is not a step number)"]
    (huge / "tokenizer_config.json").write_text('{"model_max_length": 1' + "0" * 200 + "}")  # bounded still
    assert "tokenizer_config.json: not valid JSON: integer of 201 digits is out of range" in inspect_dir(huge).problems


def test_zero3_and_plain_model_and_adapter_dirs(tmp_path):
    z3 = inspect_dir(hf_trainer_ckpt(tmp_path / "z3", ranks=4, stage=3, bf16=False))
    assert (z3.world_size, z3.zero_stage, z3.dtype) == (4, 3, "bfloat16")  # fp16/bf16 off in DeepSpeed: the config's dtype
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"w": torch.zeros(2, dtype=torch.float16)}, str(model / "model.safetensors"))
    facts = inspect_dir(model)
    assert (facts.kind, facts.step, facts.dtype, facts.weights) == ("hf-model", 0, "float16", "full")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8}))
    save_file({"a": torch.zeros(2)}, str(adapter / "adapter_model.safetensors"))
    facts = inspect_dir(adapter)
    assert (facts.kind, facts.weights, facts.dtype) == ("peft-adapter", "adapter", "float32")


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-20])


@pytest.mark.parametrize("damage,named", [
    (lambda c: _truncate(c / "model.safetensors"), "model.safetensors: "),
    (lambda c: _truncate(c / "global_step4" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
     "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt: not a whole torch file"),
    (lambda c: (c / "global_step4" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink(), "optimizer shards of ranks [0, 2]"),
    (lambda c: (c / "rng_state_1.pth").unlink(), "rng_state_<rank>.pth: ranks [0, 2]"),
    (lambda c: (c / "latest").write_text("global_step9"), "latest: names 'global_step9'"),
    (lambda c: (c / "trainer_state.json").write_text("{}"), "trainer_state.json: no global_step"),
    (lambda c: (c / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-00002.safetensors"}})),
     "names 1 missing shard(s): model-00002.safetensors"),
])
def test_damage_is_named_and_nothing_is_imported(tmp_path, damage, named):
    src = hf_trainer_ckpt(tmp_path / "theirs", ranks=3)
    damage(src)
    with pytest.raises(CheckpointDamaged) as exc:
        import_dir(src, tmp_path / "ours")
    assert named in exc.value.found, exc.value.found
    assert not (tmp_path / "ours").exists()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swiftslurm", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "250"})


def test_cli_says_what_it_imported_and_refuses_with_one_message(tmp_path):
    src = hf_trainer_ckpt(tmp_path / "theirs")
    ok = run_cli("import", str(src), "--into", str(tmp_path / "ours"))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    text = " ".join(ok.stdout.split())
    assert "step 4" in text and "world size 2" in text and "ZeRO stage 2" in text and "dtype bfloat16" in text
    assert run_cli("verify", str(tmp_path / "ours")).returncode == 0
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    for path, code, words in ((tmp_path / "junk", 2, "not a checkpoint swiftslurm can import"),
                              (tmp_path / "missing", 2, "the path does not exist"),
                              (tmp_path / "ours" / "checkpoint-4", 2, "a swiftslurm checkpoint already")):
        r = run_cli("import", str(path), "--into", str(tmp_path / "x"))
        out = " ".join((r.stdout + r.stderr).split())
        assert r.returncode == code and words in out and "Traceback" not in out, out
    _truncate(src / "model.safetensors")
    r = run_cli("import", str(src), "--into", str(tmp_path / "y"))
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 5 and "model.safetensors" in out and "Traceback" not in out, out


# ---------------------------------------------------------------- weights only


# tiny-vl's file holds LLaVA's legacy names (language_model.model.*), tiny-moe's its experts one by one: transformers'
# save_pretrained writes them so, and the load converts them back
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-vl", "tiny-moe"])
def test_full_weights_load_into_a_fresh_model_and_a_misfit_is_one_error(tmp_path, name):
    from swiftslurm.train.resume.weights import load_full
    from swiftslurm.train.tinymodel import build_model, build_processing
    from swiftslurm.train.vision import tokenizer_of

    vocab = len(tokenizer_of(build_processing(name)))
    trained = build_model(vocab, 128, seed=1, name=name)
    trained.save_pretrained(tmp_path / "model")
    fresh = build_model(vocab, 128, seed=2, name=name)
    load_full(fresh, tmp_path / "model", "full")
    for (key, a), (_, b) in zip(trained.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert torch.equal(a, b), key
    # export reads a checkpoint without ZeRO shards the same way
    from swiftslurm.export.source import Source
    from swiftslurm.export.weights import full_model

    src = Source(checkpoint=tmp_path / "model", manifest=None, lora=False, base_model=None, train_dtype="fp32",  # type: ignore[arg-type]
                 zero_tag=None, zero_stage=None, takes_images=name == "tiny-vl")
    exported = full_model(src, lambda _line: None).state_dict()
    assert exported.keys() == trained.state_dict().keys()
    assert all(torch.equal(exported[k], v) for k, v in trained.state_dict().items())
    other = build_model(vocab, 128, seed=2, hidden_size=32, name=name)
    with pytest.raises(RuntimeEnvError, match="do not fit train.model"):
        load_full(other, tmp_path / "model", "full")


# ---------------------------------------------------------------- spec keys

SPEC = """
[job]
name = "t"
output_dir = "out"
[train]
model = "tiny-llama"
dataset = ["{data}"]
{extra}
"""


def test_spec_keys_are_checked(tmp_path):
    from swiftslurm.spec import check_files, parse_spec

    data = Path(__file__).resolve().parents[1] / "examples" / "data" / "alpaca_demo.jsonl"
    with pytest.raises(SpecError) as exc:
        parse_spec(SPEC.format(data=data, extra="resume_weights_only = true"))
    assert "needs train.resume_from" in str(exc.value.problems)
    with pytest.raises(SpecError) as exc:
        parse_spec(SPEC.format(data=data, extra=f'resume_from = "{tmp_path}"\ncommand = ["python", "x.py"]'))
    assert "drop one of them" in str(exc.value.problems)
    spec = parse_spec(SPEC.format(data=data, extra='resume_from = "runs/old/checkpoint-5"'))
    with pytest.raises(SpecError) as exc:
        check_files(spec, tmp_path)
    (problem,) = exc.value.problems
    assert problem.path == "train.resume_from" and problem.what == "checkpoint directory not found"
    assert problem.found == str(tmp_path / "runs/old/checkpoint-5")
    (tmp_path / "runs/old/checkpoint-5").mkdir(parents=True)
    check_files(spec, tmp_path)


# ---------------------------------------------------------------- where a run starts (one rank, no process group)

GOLDEN = Path(__file__).resolve().parent / "data" / "checkpoints" / "v2" / "checkpoint-5"


def start_of(tmp_path: Path, resume_from: Path, weights_only: bool = False):
    from swiftslurm.spec import parse_spec
    from swiftslurm.train.resume.source import resolve_start

    data = Path(__file__).resolve().parents[1] / "examples" / "data" / "alpaca_demo.jsonl"
    extra = f'resume_from = "{resume_from}"' + ("\nresume_weights_only = true" if weights_only else "")
    spec = parse_spec(SPEC.format(data=data, extra=extra))
    return resolve_start(True, spec, str(tmp_path / "new"), 0, "node0")


def test_resume_from_is_verified_and_a_run_with_its_own_checkpoint_ignores_it(tmp_path):
    import shutil

    first = tmp_path / "first"
    shutil.copytree(GOLDEN, first / "checkpoint-5")
    start = start_of(tmp_path, first / "checkpoint-5")
    assert (start.path, start.full_resume, start.source) == (str(first / "checkpoint-5"),) * 2 + ("resume_from",)
    shutil.copytree(GOLDEN, first / "checkpoint-9")  # a run's output dir: its newest verified (9 is damaged)
    (first / "checkpoint-9" / "trainer_state.json").write_text("{}")
    assert start_of(tmp_path, first).path == str(first / "checkpoint-5")
    # (another world size is no reason to refuse here: the trainer converts it, tests/test_worldsize.py)
    assert start_of(tmp_path, first / "checkpoint-5", weights_only=True).weights_only
    shutil.copytree(GOLDEN, tmp_path / "new" / "checkpoint-7")  # a requeue: the run's own checkpoint wins
    (tmp_path / "new" / "checkpoint-7" / "manifest.json").write_text(
        (GOLDEN / "manifest.json").read_text())  # step 5 in checkpoint-7: damaged, so resume_from is used again
    assert start_of(tmp_path, first / "checkpoint-5").source == "resume_from"
    shutil.rmtree(tmp_path / "new" / "checkpoint-7")
    shutil.copytree(GOLDEN, tmp_path / "new" / "checkpoint-5")
    own = start_of(tmp_path, first / "checkpoint-9")  # even with a damaged resume_from: never looked at
    assert (own.path, own.source) == (str(tmp_path / "new" / "checkpoint-5"), "own")


def test_a_damaged_resume_from_is_exit_5_naming_the_file(tmp_path):
    import shutil

    bad = tmp_path / "bad" / "checkpoint-5"
    shutil.copytree(GOLDEN, bad)
    (bad / "rng_state_1.pth").write_bytes(b"x" * 32)
    with pytest.raises(SwiftSlurmError) as exc:
        start_of(tmp_path, bad)
    assert exc.value.exit_code == 5 and "rng_state_1.pth" in exc.value.found and "checksum mismatch" in exc.value.found


def test_a_foreign_resume_from_is_imported_into_the_new_run(tmp_path):
    src = hf_trainer_ckpt(tmp_path / "theirs")
    start = start_of(tmp_path, src)
    assert start.path == str(tmp_path / "new" / "resume-source" / "checkpoint-4") and not start.weights_only
    assert ck.verify(start.path).ok and ck.list_checkpoints(tmp_path / "new") == []  # never the run's own resume point
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"w": torch.zeros(2)}, str(model / "model.safetensors"))
    assert start_of(tmp_path, model).weights_only  # a model dir holds no training state


def test_an_imported_checkpoint_resumes_with_a_warning_naming_its_origin(tmp_path, caplog):
    import logging

    from swiftslurm.checkpoint.fingerprint import check_spec_drift

    _, final = import_dir(hf_trainer_ckpt(tmp_path / "theirs"), tmp_path / "ours")
    with caplog.at_level(logging.WARNING):
        check_spec_drift(final, spec=None, ds_config=None, log=logging.getLogger("t"))
    assert "checkpoint-4 was imported (hf-trainer, written by another tool)" in caplog.text


def test_an_adapter_loads_into_a_fresh_lora_model_and_a_misfit_is_one_error(tmp_path):
    from peft import LoraConfig, get_peft_model

    from swiftslurm.train.resume.weights import load_adapter, load_full
    from swiftslurm.train.tinymodel import build_model, build_tokenizer

    vocab = len(build_tokenizer())

    def lora(seed, r=4):
        torch.manual_seed(seed)
        return get_peft_model(build_model(vocab, 128, seed=0), LoraConfig(r=r, target_modules=["q_proj", "v_proj"], init_lora_weights=False))

    trained = lora(1)
    trained.save_pretrained(tmp_path / "adapter")
    fresh = lora(2)
    load_full(fresh, tmp_path / "adapter", "lora")  # adapter only: nothing for the base model
    load_adapter(fresh, tmp_path / "adapter")
    lora_weights = {k: v for k, v in trained.state_dict().items() if "lora_" in k}
    assert lora_weights and all(torch.equal(v, fresh.state_dict()[k]) for k, v in lora_weights.items())
    with pytest.raises(RuntimeEnvError, match="a LoRA adapter only"):
        load_full(build_model(vocab, 128, seed=0), tmp_path / "adapter", "full")
    with pytest.raises(RuntimeEnvError, match="does not fit this LoRA setup"):
        load_adapter(lora(3, r=8), tmp_path / "adapter")
