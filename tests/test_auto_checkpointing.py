"""``train.gradient_checkpointing = "auto"`` (the default): ``plan`` turns it off where its memory estimate without
it fits the GPU, on elsewhere; the nodes get the decision as a bool, the banner says which and why, and an explicit
true/false wins. Issue #34."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from swiftslurm.node.banner import banner_rows
from swiftslurm.plan import make_plan, read_plan_task, write_plan
from swiftslurm.slurm.distenv import derive
from swiftslurm.spec.load import parse_toml, validate_spec
from swiftslurm.train.build import resolve_auto_checkpointing

sys.path.insert(0, str(Path(__file__).parent))
from test_distenv import slurm_env  # noqa: E402
from test_sizing import cli, spec_file  # noqa: E402

LLAMA3_8B = ("[train.model_shape]\nhidden_size = 4096\nnum_layers = 32\nheads = 32\nkv_heads = 8\n"
             "intermediate_size = 14336\nvocab_size = 128256\ntie_word_embeddings = false")
# the shape issue #34 measured: Llama-3-8B, LoRA r16 on all linear layers, ZeRO-2, 4096-token rows, micro-batch 2, one GPU
LORA_8B = ('model = "meta-llama/Meta-Llama-3-8B"\nbf16 = true\nlora_rank = 16\nmax_length = 4096\n'
           "per_device_train_batch_size = 2\n{extra}\n" + LLAMA3_8B)


def plan_json(tmp_path: Path, gpu_gb: float, extra: str = "") -> dict:
    path = spec_file(tmp_path, LORA_8B.format(extra=extra), slurm=f"nodes = 1\ntasks_per_node = 1\ngpus_per_node = 1\ngpu_memory_gb = {gpu_gb}")
    run = cli(path, "plan", "--json")
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_plan_turns_checkpointing_off_where_the_estimate_fits_and_on_where_it_does_not(tmp_path):
    big = plan_json(tmp_path, 141)  # an H200
    [m] = big["memory"]
    assert m["gradient_checkpointing"]["on"] is False and m["fits"], m
    assert "off (auto)" in m["gradient_checkpointing"]["why"] and "gpu_memory_gb = 141" in m["gradient_checkpointing"]["why"]
    [task] = big["tasks"]
    assert task["spec"]["train"]["gradient_checkpointing"] is False  # the nodes read a bool, not "auto"
    assert task["decisions"]["train.gradient_checkpointing"].startswith("off (auto)")
    small = plan_json(tmp_path, 24)
    [m] = small["memory"]
    assert m["gradient_checkpointing"]["on"] is True and "does not fit without" in m["gradient_checkpointing"]["why"]
    assert small["tasks"][0]["spec"]["train"]["gradient_checkpointing"] is True
    # the estimate it decided by is the one plan shows: with checkpointing on, 24 GB is what it sizes against
    assert m["per_rank_gib"]["activations"] < big["memory"][0]["per_rank_gib"]["activations"]


def test_an_explicit_value_wins_and_is_not_a_decision(tmp_path):
    for value in ("true", "false"):
        plan = plan_json(tmp_path, 141, f"gradient_checkpointing = {value}")
        [m] = plan["memory"]
        assert "gradient_checkpointing" not in m and plan["tasks"][0]["decisions"] == {}
        assert plan["tasks"][0]["spec"]["train"]["gradient_checkpointing"] is (value == "true")


def test_the_margin_decides_at_the_edge(tmp_path):
    """Just above the estimate without checkpointing is not enough: the 15% margin must fit too."""
    bare = plan_json(tmp_path, 1000, "gradient_checkpointing = false")["memory"][0]["total_gib"]
    assert plan_json(tmp_path, round(bare * 1.10, 1))["memory"][0]["gradient_checkpointing"]["on"] is True
    assert plan_json(tmp_path, round(bare * 1.16 + 0.1, 1))["memory"][0]["gradient_checkpointing"]["on"] is False


def test_cpu_jobs_and_unknown_shapes_keep_it_on(tmp_path):
    cpu = spec_file(tmp_path, 'model = "tiny-llama"')
    [m] = json.loads(cli(cpu, "plan", "--json").stdout)["memory"]
    assert m["gradient_checkpointing"]["on"] is True and "CPU job" in m["gradient_checkpointing"]["why"]
    hub = spec_file(tmp_path, 'model = "org/not-on-disk"', slurm="nodes = 1\ngpus_per_node = 1\ngpu_memory_gb = 1000")
    [m] = json.loads(cli(hub, "plan", "--json").stdout)["memory"]
    assert m["gradient_checkpointing"]["on"] is True and "shape is unknown" in m["gradient_checkpointing"]["why"]


def test_the_banner_says_which_and_why(tmp_path):
    path = spec_file(tmp_path, LORA_8B.format(extra=""), slurm="nodes = 1\ntasks_per_node = 1\ngpus_per_node = 1\ngpu_memory_gb = 141")
    text = cli(path, "plan").stdout
    assert "gradient checkpointing" in text and "off (auto)" in text
    raw = parse_toml(path.read_text())
    plan_file = write_plan(make_plan(validate_spec(raw), raw, str(tmp_path), check_disk=True))  # as submit writes it
    _, task, _ = read_plan_task(plan_file, 0)
    dist = derive(slurm_env(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0"))
    rows = dict(banner_rows(dist, task.spec, task.output_dir, "train", "none", {}, task.decisions))
    assert rows["gradient checkpointing"].startswith("off (auto): estimated")
    explicit = validate_spec(parse_toml('[job]\nname = "j"\n[train]\nmodel = "tiny-llama"\ndataset = "d.jsonl"\ngradient_checkpointing = false\n'))
    assert dict(banner_rows(dist, explicit, "o", "train", "none", {}))["gradient checkpointing"] == "off (set in the spec)"


def test_a_spec_trained_without_plan_resolves_auto_the_same_way():
    spec = validate_spec(parse_toml('[job]\nname = "j"\n[train]\nmodel = "tiny-llama"\ndataset = "d.jsonl"\n'))
    assert spec.train.gradient_checkpointing == "auto"
    assert resolve_auto_checkpointing(spec, {}).train.gradient_checkpointing is True  # a CPU job: on, as before
    gpu = validate_spec(parse_toml('[job]\nname = "j"\n[slurm]\ngpus_per_node = 1\ngpu_memory_gb = 141\n[train]\n'
                                   'model = "tiny-llama"\ndataset = "d.jsonl"\n'))
    assert resolve_auto_checkpointing(gpu, {"zero_optimization": {"stage": 2}}).train.gradient_checkpointing is False
