"""`swiftslurm export`: a verified checkpoint of a real run (tests/one_process_runs.py: one step, the tiny model, real
DeepSpeed on the CPU) as a Hugging Face model dir, checked by loading it with the libraries users load it with.

- a LoRA (ZeRO-2) run merged: the exported model's logits equal base + adapter (peft's own loading) to 1e-4; it
  loads with ``from_pretrained`` from safetensors shards and their index, generates, and keeps the chat template;
- a full bf16 ZeRO-3 run: the export equals DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` of the
  shards (the fp32 master weights, not the checkpoint's bf16 ``model.safetensors``), in the dtype asked;
- ``swiftslurm verify`` passes on an export and fails on a flipped byte; a damaged or foreign source and a
  non-empty ``--to`` are refused with one message and the exit code, writing nothing;
- the Slurm job's script (pure) and, on the cluster, one real export job sent from a login side that never imports torch.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from swiftslurm.export.job import ExportRequest, export_argv, export_job
from swiftslurm.export.source import ExportRefused, find_source

ROOT = Path(__file__).resolve().parent.parent
LORA, ZERO3 = "export_lora", "export_zero3"
RM_LORA, RM_FULL = "export_rm_lora", "export_rm_full"


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swiftslurm", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "250", **(env or {})})


def flip_byte(path: Path, offset: int = -100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Four one-step runs, each with its checkpoint-1: LoRA under ZeRO-2, full bf16 under ZeRO-3, and a reward model
    (task = "rm") with LoRA and with full weights under ZeRO-2."""
    out = tmp_path_factory.mktemp("export-runs")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "one_process_runs.py"), str(out), LORA, ZERO3, RM_LORA, RM_FULL],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    rows = [json.loads(ln[len("PRESET "):]) for ln in proc.stdout.splitlines() if ln.startswith("PRESET ")]
    assert proc.returncode == 0 and [r["ok"] for r in rows] == [True] * 4, proc.stdout[-3000:] + proc.stderr[-3000:]
    (out / "rows.json").write_text(json.dumps({r["preset"]: r for r in rows}))
    return out


@pytest.fixture(scope="module")
def lora_export(runs, tmp_path_factory) -> tuple[Path, dict]:
    """The LoRA run's output dir exported through the CLI (--json), in shards small enough to need an index."""
    to = tmp_path_factory.mktemp("lora-export") / "model"
    proc = cli("export", str(runs / LORA), "--to", str(to), "--json", "--max-shard-size", "100KB")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return to, json.loads(proc.stdout)


def _batch():
    from swiftslurm.train.tinymodel import build_tokenizer

    tok = build_tokenizer()
    return tok, tok(["Hello, world", "swiftslurm exports models"], return_tensors="pt", padding=True)


def _logits(model, batch):
    import torch

    with torch.no_grad():
        return model.eval()(**batch).logits


@pytest.mark.slow
def test_lora_export_is_the_base_plus_adapter_and_loads_and_generates(runs, lora_export):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swiftslurm.train.tinymodel import build_model

    to, facts = lora_export
    ckpt = runs / LORA / "checkpoint-1"
    assert facts["weights"] == "merged-lora" and facts["dtype"] == "fp32" and facts["base_model"] == "tiny-llama"
    assert facts["source_checkpoint"] == str(ckpt) and facts["step"] == 1 and facts["path"] == str(to)
    assert "model.safetensors.index.json" in facts["files"] and sum(f.endswith(".safetensors") for f in facts["files"]) >= 2
    assert not any(p.name.startswith(".") for p in to.parent.iterdir()), "the staging dir is gone"

    tok, batch = _batch()
    exported = AutoModelForCausalLM.from_pretrained(str(to))
    reference = PeftModel.from_pretrained(build_model(len(tok), 128, 42), str(ckpt))  # base + adapter, as peft loads them
    got, want, base = _logits(exported, batch), _logits(reference, batch), _logits(build_model(len(tok), 128, 42), batch)
    assert (got - want).abs().max().item() < 1e-4
    assert (got - base).abs().max().item() > 1e-3, "the adapter changed nothing: the test would not see a merge missing"

    out = exported.generate(**tok(["Hi"], return_tensors="pt"), max_new_tokens=4, do_sample=False)
    assert out.shape[1] > 2
    saved = AutoTokenizer.from_pretrained(str(to))
    assert saved.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True).endswith("<|assistant|>\n")


@pytest.mark.slow
@pytest.mark.parametrize("preset", [RM_LORA, RM_FULL])
def test_a_reward_model_exports_as_a_sequence_classifier_that_scores_as_the_trained_one(runs, tmp_path, preset):
    """Its score head (trained whole, under LoRA as peft's modules_to_save) goes with it, and the LM head it never had
    is not asked for: both were refused before ("the adapter does not fit", "weights do not fit config.json")."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    from swiftslurm.train.tinymodel import build_model

    ckpt = runs / preset / "checkpoint-1"
    proc = cli("export", str(runs / preset), "--to", str(tmp_path / "rm"), "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    facts = json.loads(proc.stdout)
    assert facts["model_class"] == "AutoModelForSequenceClassification" and facts["weights"] == ("merged-lora" if preset == RM_LORA else "full")
    exported = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "rm"))
    tok, batch = _batch()
    fresh = build_model(len(tok), 128, 42, reward_head=True)
    if preset == RM_LORA:
        trained = PeftModel.from_pretrained(build_model(len(tok), 128, 42, reward_head=True), str(ckpt))
    else:
        from safetensors.torch import load_file

        trained = fresh.__class__(fresh.config)
        trained.load_state_dict(load_file(str(ckpt / "model.safetensors")))
    got, want, before = (_logits(m, batch) for m in (exported, trained, fresh))
    assert got.shape == (2, 1) and (got - want).abs().max().item() < 1e-4
    assert (got - before).abs().max().item() > 1e-4, "training changed no score: the test would not see a fresh head exported"
    head = exported.state_dict()["score.weight"]
    assert not torch.equal(head, fresh.state_dict()["score.weight"]), "the exported score head is not the trained one"


@pytest.mark.slow
def test_zero3_export_equals_the_gathered_fp32_master_weights(runs, tmp_path):
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from swiftslurm.export.run import export_here

    ckpt = runs / ZERO3 / "checkpoint-1"
    reference = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    sixteen = load_file(str(ckpt / "model.safetensors"))  # what HF saved beside the shards: bf16
    assert any(not torch.equal(sixteen[k].float(), v) for k, v in reference.items()), "the shards must hold more than the bf16 file"

    full = export_here(str(ckpt), tmp_path / "fp32", dtype="fp32")
    state = AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp32")).state_dict()
    assert full.weights == "full" and set(reference) <= set(state)
    assert all(torch.equal(state[k], v) for k, v in reference.items())

    auto = export_here(str(ckpt), tmp_path / "auto")  # the run trained in bf16: so is the default export
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "auto"), dtype="auto")
    assert auto.dtype == "bf16" and model.dtype == torch.bfloat16
    assert json.loads((tmp_path / "auto" / "config.json").read_text())["dtype"] == "bfloat16"
    assert all(torch.equal(model.state_dict()[k], v.to(torch.bfloat16)) for k, v in reference.items())


@pytest.mark.slow
def test_verify_passes_on_an_export_and_fails_on_a_flipped_byte(lora_export, tmp_path):
    to = shutil.copytree(lora_export[0], tmp_path / "model")
    ok = cli("verify", str(to))
    assert ok.returncode == 0 and "verified" in ok.stdout, ok.stdout + ok.stderr
    flip_byte(next(to.glob("model-00001-of-*.safetensors")))
    bad = cli("verify", str(to))
    assert bad.returncode == 5 and "model-00001-of-" in bad.stdout + bad.stderr, bad.stdout + bad.stderr


@pytest.mark.slow
def test_a_damaged_or_foreign_source_is_refused_with_one_message(runs, tmp_path):
    ckpt = shutil.copytree(runs / ZERO3 / "checkpoint-1", tmp_path / "run" / "checkpoint-1")
    shard = next((ckpt / "global_step1").glob("*optim_states.pt"))
    flip_byte(shard)
    r = cli("export", str(ckpt), "--to", str(tmp_path / "model"))
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 5 and "the checkpoint to export is damaged" in out and shard.name in out and "Traceback" not in out, out
    flip_byte(shard)  # whole again; without our manifest it is foreign
    (ckpt / "manifest.json").unlink()
    r = cli("export", str(ckpt), "--to", str(tmp_path / "model"))
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 5 and "not a checkpoint of ours" in out and "swiftslurm import" in out and "Traceback" not in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"], "nothing written, not even a staging dir"


@pytest.mark.slow
def test_a_non_empty_to_is_refused_and_left_untouched(runs, tmp_path):
    to = tmp_path / "model"
    to.mkdir()
    (to / "notes.txt").write_text("mine")
    r = cli("export", str(runs / LORA), "--to", str(to))
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2 and "new or empty directory" in out and "notes.txt" in out and "Traceback" not in out, out
    assert [p.name for p in to.iterdir()] == ["notes.txt"] and (to / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_the_export_stages_in_a_dir_it_made_and_leaves_what_holds_the_old_staging_name(runs, tmp_path):
    """The staging dir used to be `.<to>.exporting-<pid>`, removed first as "our leftover": a dir of anyone's
    under that name (the pid is guessable) would have been deleted. Now each export makes a new one."""
    from swiftslurm.export.run import export_here

    to = tmp_path / "model"
    theirs = tmp_path / f".model.exporting-{os.getpid()}"
    theirs.mkdir()
    (theirs / "keep.txt").write_text("not the export's")
    done = export_here(str(runs / LORA), to, adapter_only=True)
    assert Path(done.path) == to.absolute() and (to / "adapter_config.json").is_file()
    assert (theirs / "keep.txt").read_text() == "not the export's"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["model", theirs.name])  # no staging dir left


@pytest.mark.slow
def test_an_output_dir_exports_its_best_else_its_newest_verified_checkpoint(runs, tmp_path):
    task = shutil.copytree(runs / LORA, tmp_path / "run")
    newer = shutil.copytree(task / "checkpoint-1", task / "checkpoint-2")  # its manifest says step 1: damaged as checkpoint-2
    src = find_source(str(task))
    assert src.checkpoint == task / "checkpoint-1" and src.lora and src.base_model == "tiny-llama"
    assert len(src.skipped) == 1 and src.skipped[0].startswith("checkpoint-2: ")
    (task / "latest_best").write_text("checkpoint-1\n")
    assert find_source(str(task)).checkpoint == task / "checkpoint-1" and not find_source(str(task)).skipped
    for pointer in ("../checkpoint-1", "checkpoint-x"):
        (task / "latest_best").write_text(pointer)
        with pytest.raises(ExportRefused, match="latest_best"):
            find_source(str(task))
    shutil.rmtree(newer)


@pytest.mark.slow
def test_adapter_only_keeps_the_adapter_and_missing_libraries_are_one_error(runs, lora_export, tmp_path, monkeypatch):
    from peft import PeftModel

    from swiftslurm.export.run import export_here
    from swiftslurm.export.weights import LibraryMissing, require_libraries
    from swiftslurm.train.tinymodel import build_model

    done = export_here(str(runs / LORA), tmp_path / "adapter", adapter_only=True)
    assert done.weights == "adapter" and "adapter_model.safetensors" in done.files and "config.json" not in done.files
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny-llama"
    tok, batch = _batch()
    adapted = PeftModel.from_pretrained(build_model(len(tok), 128, 42), str(tmp_path / "adapter"))
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(lora_export[0]))
    assert (_logits(adapted, batch) - _logits(merged, batch)).abs().max().item() < 1e-4

    monkeypatch.setitem(sys.modules, "peft", None)  # as if the train extra were not installed
    with pytest.raises(LibraryMissing, match="swiftslurm\\[train\\]"):
        require_libraries(find_source(str(runs / LORA)), merge=True)


@pytest.mark.slow
def test_a_zero2_save_writes_the_model_from_rank_0s_module_without_a_host_copy_of_every_weight(runs):
    """Under ZeRO-2 every weight is whole on every rank: the save writes the adapter (or the full weights) from the
    module, tensor by tensor; the Trainer's path had accelerate copy the whole state dict to host memory on every rank
    first (16 GB a rank for the 8B LoRA run). ZeRO-3 gathers through DeepSpeed, as before. The bytes are a
    synchronous save's either way (the export tests load them)."""
    rows = json.loads((runs / "rows.json").read_text())
    assert rows[LORA]["state_dict_copies"] == rows[RM_LORA]["state_dict_copies"] == rows[RM_FULL]["state_dict_copies"] == 0
    assert rows[ZERO3]["state_dict_copies"] == 1  # the consolidated 16-bit weights: DeepSpeed's gather, every rank
    assert (runs / LORA / "checkpoint-1" / "adapter_model.safetensors").is_file()
    assert (runs / RM_FULL / "checkpoint-1" / "model.safetensors").is_file()


def test_the_base_of_an_adapter_is_the_flag_else_the_runs_model_else_the_adapters_own_config(tmp_path):
    """Pure (no tensor loaded): ``--base-model`` wins, then the manifest's train.model, then peft's
    base_model_name_or_path; what trained a reward model's adapter (peft's SEQ_CLS) is a score head."""
    from swiftslurm.checkpoint import Manifest
    from swiftslurm.export.source import describe

    ckpt = tmp_path / "checkpoint-3"
    ckpt.mkdir()
    (ckpt / "adapter_model.safetensors").write_bytes(b"")
    (ckpt / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/base-7b", "task_type": "SEQ_CLS"}))
    bare = Manifest(step=3, algo="xxh3_128", files={}, meta={})
    run = Manifest(step=3, algo="xxh3_128", files={}, meta={"spec_fingerprint": {"train.model": "/models/base", "train.task": "sft"}})
    assert describe(ckpt, bare).base_model == "org/base-7b" and describe(ckpt, bare).score_head
    assert describe(ckpt, run).base_model == "/models/base" and not describe(ckpt, run).score_head  # the run's own record wins
    assert describe(ckpt, run, base_model="/elsewhere/base").base_model == "/elsewhere/base"
    (ckpt / "adapter_config.json").write_text(json.dumps({"task_type": "CAUSAL_LM"}))
    assert describe(ckpt, bare).base_model is None and not describe(ckpt, bare).score_head  # then export asks for --base-model


# ---------------------------------------------------------------- the Slurm job


def test_the_export_job_runs_the_same_export_with_every_word_quoted(tmp_path):
    hostile = "/runs/a'; echo pwned $(id)\n/checkpoint-3"
    req = ExportRequest(hostile, tmp_path / "my model", task=2, adapter_only=True, dtype="bf16", partition="gpu", account="ml-team",
                        time="01:30:00", cpus=4, mem="64G", python="/opt/venv/bin/python")
    options, script = export_job(req)
    assert options == ["--job-name=swiftslurm-export", "--nodes=1", "--ntasks=1", "--cpus-per-task=4", "--time=01:30:00",
                       f"--output={tmp_path}/my model.export-%j.log", "--partition=gpu", "--account=ml-team", "--mem=64G"]
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    command = script[script.index("\nexec ") + len("\nexec "):]  # the hostile path's newline stays inside its quotes
    assert shlex.split(command) == export_argv(req)
    assert export_argv(req)[:8] == ["/opt/venv/bin/python", "-m", "swiftslurm", "export", hostile, "--to", f"{tmp_path}/my model", "--executor"]
    assert "--adapter-only" in export_argv(req) and export_argv(req)[export_argv(req).index("--task") + 1] == "2"
    for bad in ({"partition": "gpu --wrap=x"}, {"time": "soon"}, {"mem": "lots"}):
        with pytest.raises(ExportRefused):
            export_job(ExportRequest("/src", tmp_path / "m", **bad))  # type: ignore[arg-type]


RECORDER = """
import atexit, json, os, sys

def _record():
    with open(os.environ["SWIFTSLURM_TEST_MODULES"], "w") as fh:
        json.dump(sorted({name.partition(".")[0] for name in sys.modules}), fh)

atexit.register(_record)
"""


@pytest.mark.slurm
@pytest.mark.slow
def test_an_export_job_on_the_cluster_sent_without_torch(runs, tmp_path, slurm_cluster):
    from conftest import wait_for_job

    (tmp_path / "recorder").mkdir()
    (tmp_path / "recorder" / "sitecustomize.py").write_text(RECORDER)
    record = tmp_path / "modules.json"
    to = tmp_path / "adapter"
    env = {"SWIFTSLURM_TEST_MODULES": str(record),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "recorder"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = cli("export", str(runs / LORA / "checkpoint-1"), "--to", str(to), "--adapter-only", "--executor", "slurm", "--cpus", "1",
            "--time", "10", "--json", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    sent = json.loads(r.stdout)
    assert not {"torch", "deepspeed", "transformers"} & set(json.loads(record.read_text())), "the login side imported torch"
    states = wait_for_job(sent["job_id"], timeout_s=300)
    log = Path(sent["log"])
    assert states == {sent["job_id"]: "COMPLETED"}, log.read_text()[-3000:] if log.exists() else states
    assert cli("verify", str(to)).returncode == 0 and (to / "adapter_model.safetensors").is_file()


def test_a_copied_run_dir_exports_its_own_checkpoints_never_the_originals(runs, tmp_path):
    """The dir named is the one read: a copy's record still names the original's dirs (absolute, as written at
    submit), and its own newest checkpoint is damaged, so the copy has nothing verified to export."""
    from swiftslurm.errors import CheckpointDamaged
    from swiftslurm.jobs.record import Submission, update_record
    from swiftslurm.jobs.target import resolve

    original = shutil.copytree(runs / LORA, tmp_path / "original")
    update_record(Submission("slurm", ["41"], str(original), [str(original)], str(original / "logs" / "submitit")))
    copy = shutil.copytree(original, tmp_path / "copy")
    flip_byte(next(p for p in sorted((copy / "checkpoint-1").rglob("*")) if p.is_file() and p.name != "manifest.json"))
    assert [r.task_dir for r in resolve(str(copy))[1]] == [str(copy)]
    with pytest.raises(CheckpointDamaged, match="copy verifies"):  # before: the original's checkpoint, "verified"
        find_source(str(copy))
    assert find_source(str(original)).checkpoint == original / "checkpoint-1"
    planted = tmp_path / "planted"  # a record naming another dir outright: not followed, nothing read there
    planted.mkdir()
    update_record(Submission("slurm", ["42"], str(planted), [str(original)], str(planted / "logs" / "submitit")))
    sub, refs = resolve(str(planted))
    assert [r.task_dir for r in refs] == [""] and sub._unfollowed == (str(original),)
    with pytest.raises(ExportRefused):
        find_source(str(planted))
