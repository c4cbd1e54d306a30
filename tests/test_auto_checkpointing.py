"""``train.gradient_checkpointing = "auto"`` (the default): ``plan`` turns it off where its memory estimate without
it fits the GPU, on elsewhere; the nodes get the decision as a bool, the banner says which and why, and an explicit
true/false wins. Issue #34."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from swiftslurm.node.banner import banner_rows
from swiftslurm.plan import make_plan, read_plan_task, write_plan
from swiftslurm.sizing.check import AUTO_CHECKPOINTING_MARGIN
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
        assert "gradient_checkpointing" not in m and "train.gradient_checkpointing" not in plan["tasks"][0]["decisions"]
        assert plan["tasks"][0]["spec"]["train"]["gradient_checkpointing"] is (value == "true")


def test_the_margin_decides_at_the_edge(tmp_path):
    """Just above the estimate without checkpointing is not enough: the margin must fit too."""
    bare = plan_json(tmp_path, 1000, "gradient_checkpointing = false")["memory"][0]["total_gib"]
    assert plan_json(tmp_path, round(bare * (1 + AUTO_CHECKPOINTING_MARGIN) - 0.1, 1))["memory"][0]["gradient_checkpointing"]["on"] is True
    assert plan_json(tmp_path, round(bare * (1 + AUTO_CHECKPOINTING_MARGIN) + 0.1, 1))["memory"][0]["gradient_checkpointing"]["on"] is False


def test_where_all_activations_do_not_fit_only_the_fewest_layers_that_must_recompute(tmp_path):
    """Issue #53: the 8B LoRA at 80 GB recomputed all 32 layers (a third of the step) where a few were enough. Between
    "none fits" and "all are needed" auto takes the fewest first layers whose estimate plus the margin fits: one
    layer fewer would not fit, and the nodes get the count."""
    plan = plan_json(tmp_path, 60)
    [m], [task] = plan["memory"], plan["tasks"]
    decided = m["gradient_checkpointing"]
    k = decided["layers"]
    assert decided["on"] and 1 < k < 32, decided
    assert f"on for the first {k} of 32 layers" in decided["why"], decided
    assert m["total_gib"] * (1 + AUTO_CHECKPOINTING_MARGIN) <= 60  # the estimate plan shows is the one with k
    assert task["spec"]["train"]["gradient_checkpointing"] is True and task["spec"]["train"]["gradient_checkpointing_layers"] == k
    fewer = plan_json(tmp_path, 1000, f"gradient_checkpointing = true\ngradient_checkpointing_layers = {k - 1}")["memory"][0]
    assert fewer["total_gib"] * (1 + AUTO_CHECKPOINTING_MARGIN) > 60
    # the more layers recompute, the smaller the estimate: all of them is the old "on"
    totals = [plan_json(tmp_path, 1000, f"gradient_checkpointing = true\ngradient_checkpointing_layers = {n}")["memory"][0]["total_gib"]
              for n in (1, 8, 16, 32)]
    assert totals == sorted(totals, reverse=True) and totals[-1] == plan_json(tmp_path, 24)["memory"][0]["total_gib"]
    # a user's own count with "auto": kept when checkpointing is needed ...
    mine = plan_json(tmp_path, 60, "gradient_checkpointing_layers = 20")
    assert mine["memory"][0]["gradient_checkpointing"]["layers"] == 20
    assert mine["tasks"][0]["spec"]["train"]["gradient_checkpointing_layers"] == 20
    # ... and dropped when it is not: the nodes never read a count beside checkpointing off
    roomy = plan_json(tmp_path, 141, "gradient_checkpointing_layers = 20")["tasks"][0]["spec"]["train"]
    assert roomy["gradient_checkpointing"] is False and roomy["gradient_checkpointing_layers"] is None


def test_a_layer_count_beside_checkpointing_off_is_refused_at_validate(tmp_path):
    path = spec_file(tmp_path, LORA_8B.format(extra="gradient_checkpointing = false\ngradient_checkpointing_layers = 2"))
    run = cli(path, "validate")
    assert run.returncode == 2 and "none do" in run.stdout + run.stderr and "Traceback" not in run.stderr, run.stdout + run.stderr


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


QWEN_15B = ('model = "Qwen/Qwen2.5-1.5B"\ntrain_type = "full"\nbf16 = true\nmax_length = 4096\nper_device_train_batch_size = 2\n'
            "{extra}\n[train.model_shape]\nhidden_size = 1536\nnum_layers = 28\nheads = 12\nkv_heads = 2\n"
            "intermediate_size = 8960\nvocab_size = 151936\ntie_word_embeddings = true\nmodel_type = \"qwen2\"")


def plan_with(tmp_path: Path, train: str, gpu_gb: float, liger_installed: bool, liger_table: str | None = None) -> dict:
    """``plan --json`` in a process whose Python has (a stand-in) liger-kernel importable, or not; ``liger_table``: the
    source of its ``transformers/monkey_patch.py`` (none: the stand-in has no such file)."""
    import os
    import subprocess

    from test_sizing import ROOT

    fake = tmp_path / "site"
    (fake / "liger_kernel" / "transformers").mkdir(parents=True, exist_ok=True)
    (fake / "liger_kernel" / "__init__.py").write_text("")
    patch = fake / "liger_kernel" / "transformers" / "monkey_patch.py"
    patch.unlink(missing_ok=True)
    if liger_table is not None:
        patch.write_text(liger_table)
    path = spec_file(tmp_path, train, slurm=f"nodes = 1\ntasks_per_node = 1\ngpus_per_node = 1\ngpu_memory_gb = {gpu_gb}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + ([str(fake)] if liger_installed else []))}
    run = subprocess.run([sys.executable, "-m", "swiftslurm", "plan", "--json", str(path)], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)["memory"][0]


def test_full_fine_tuning_of_1_5b_at_80gb_trains_without_checkpointing(tmp_path):
    """Issue #34: the estimate was 43% over the 1.5B shape's measured peak (49.8 GiB at 4096 x 2 on an H200), so "auto"
    asked for checkpointing at 80 GB (a third of the step's speed). Now off, with or without Liger's kernels counted;
    the 3B shape (measured 79.5 GiB) keeps it on at 80 GB."""
    for installed in (True, False):
        m = plan_with(tmp_path, QWEN_15B.format(extra=""), 80, installed)
        assert m["gradient_checkpointing"]["on"] is False, m
        assert ("Liger's RMSNorm, RoPE and SwiGLU counted" in m["gradient_checkpointing"]["why"]) is installed
        assert "step_reuses_activations" in m["per_rank_gib"]
    three_b = QWEN_15B.replace("hidden_size = 1536\nnum_layers = 28\nheads = 12", "hidden_size = 2048\nnum_layers = 36\nheads = 16")
    assert plan_with(tmp_path, three_b.replace("8960", "11008").format(extra=""), 80, True)["gradient_checkpointing"]["on"] is True


def test_liger_is_counted_only_for_a_model_type_liger_patches(tmp_path):
    """Liger does nothing (an info-level log line) for a model type outside its table, so the estimate counts its
    smaller activations only for a type in that table: the installed package's own (read from its source, never
    imported), else liger-kernel 0.8.5's list; a shape without a model_type is not counted (the larger estimate)."""
    counted = lambda m: "Liger's RMSNorm, RoPE and SwiGLU counted" in m["gradient_checkpointing"]["why"]  # noqa: E731
    qwen = QWEN_15B.format(extra="")
    base = plan_with(tmp_path, qwen, 80, True)
    assert counted(base)
    for other, why in ((qwen.replace('model_type = "qwen2"', 'model_type = "gpt2"'), "Liger has no kernels for model type 'gpt2'"),
                       (qwen.replace('\nmodel_type = "qwen2"', ""), "names no model_type (set train.model_shape.model_type")):
        m = plan_with(tmp_path, other, 80, True)
        assert not counted(m) and m["total_gib"] > base["total_gib"], m
        assert [n for n in m["notes"] if n.startswith("Liger's layers are not counted")] == [
            n for n in m["notes"] if why in n] and any(why in n for n in m["notes"]), m["notes"]
        without = plan_with(tmp_path, other, 80, False)  # the same estimate as without Liger at all, and no such note
        assert (m["per_rank_gib"], m["total_gib"]) == (without["per_rank_gib"], without["total_gib"])
        assert not any("Liger's layers are not counted" in n for n in without["notes"])
    # a Liger whose own table has a new type and lacks qwen2: its table decides, not the built-in list
    table = "import x\nMODEL_TYPE_TO_APPLY_LIGER_FN = {\n    'llama': x.a,\n    'newtype': x.b,\n}\n"
    assert counted(plan_with(tmp_path, qwen.replace('"qwen2"', '"newtype"'), 80, True, liger_table=table))
    assert not counted(plan_with(tmp_path, qwen, 80, True, liger_table=table))
    assert counted(plan_with(tmp_path, qwen, 80, True, liger_table="MODEL_TYPE_TO_APPLY_LIGER_FN = make()\n"))  # unreadable: the list


def test_liger_is_counted_exactly_where_the_nodes_will_run_it():
    """``sizing.check.liger_layers`` against the node's own rule (``kernels.choose.resolve_liger`` and the tasks that
    take it) over every combination: the estimate never counts Liger's smaller activations where it will not run."""
    import itertools
    from types import SimpleNamespace

    from swiftslurm.sizing import check
    from swiftslurm.train.kernels.choose import KernelError, NodeFacts, fit_liger_to_model, resolve_liger

    seen = set()
    for requested, stage, compiled, task, gpus, installed, model_type in itertools.product(
            (True, False, "auto"), (0, 2, 3), (False, True), ("sft", "pt", "dpo", "grpo"), (True, False), (True, False),
            ("qwen2", "gpt2", None)):
        t = SimpleNamespace(use_liger_kernel=requested, compile=compiled, task=task)
        try:  # the node: its rules, then the loaded model's type (sft.py; the TRL tasks never take Liger)
            config, why = resolve_liger(requested, stage, NodeFacts(cuda=gpus, liger=installed), compiled)
            if task in ("sft", "pt"):
                config, why = fit_liger_to_model(requested, config, why, model_type)
        except KernelError:
            seen.add("refused")
            continue  # the node refuses to start: nothing to size
        runs = config is not None and task in ("sft", "pt")
        seen.add(runs)
        saved = check.liger_installed
        check.liger_installed = lambda installed=installed: installed  # what this Python would find
        try:
            assert check.liger_layers(t, stage, gpus, True, model_type) is runs, (requested, stage, compiled, task, gpus, installed, model_type)
            if not check.liger_layers(t, stage, gpus, False, model_type):  # without looking, "auto" is never counted
                assert requested is not True or not runs
        finally:
            check.liger_installed = saved
    assert seen == {True, False, "refused"}


QWEN_05B_ACCUM = ('model = "Qwen/Qwen2.5-0.5B"\ntrain_type = "full"\nbf16 = true\nmax_length = 2048\n'
                  "per_device_train_batch_size = 4\ngradient_accumulation_steps = {accum}\n{extra}\n[train.model_shape]\n"
                  "hidden_size = 896\nnum_layers = 24\nheads = 14\nkv_heads = 2\nintermediate_size = 4864\nvocab_size = 151936\n"
                  "tie_word_embeddings = true\nmodel_type = \"qwen2\"")


def plan_in_process(tmp_path: Path, train: str, gpu_gb: float | None) -> dict:
    """``plan --json``'s ``memory`` entry of task 0, made in this process (``gpu_gb`` None: a CPU job)."""
    slurm = "nodes = 1\ntasks_per_node = 1" + ("" if gpu_gb is None else f"\ngpus_per_node = 1\ngpu_memory_gb = {gpu_gb}")
    raw = parse_toml(spec_file(tmp_path, train, slurm=slurm).read_text())
    return make_plan(validate_spec(raw), raw, str(tmp_path), check_disk=True).to_json()["memory"][0]


def test_plan_advises_a_larger_micro_batch_in_place_of_accumulation_where_it_fits(tmp_path, monkeypatch):
    """The same rows per optimizer step in fewer passes: the largest micro-batch whose estimate (+15%) fits, named
    with the accumulation that keeps the global batch; never without accumulation to trade, unpacked, or on a CPU."""
    from swiftslurm.sizing import check

    monkeypatch.setattr(check, "liger_installed", lambda: True)  # as on the GPU machine: Liger's layers counted
    said = lambda m: [a for a in m["advice"] if a.startswith("train.per_device_train_batch_size")]  # noqa: E731
    plan_with = lambda tmp_path, train, gb, _: plan_in_process(tmp_path, train, gb)  # noqa: E731
    h200 = plan_with(tmp_path, QWEN_05B_ACCUM.format(accum=4, extra=""), 141, True)
    assert said(h200) == [said(h200)[0]] and said(h200)[0].startswith(
        "train.per_device_train_batch_size = 16 with gradient_accumulation_steps = 1: the same 16 rows per optimizer step in 1 pass instead of 4"), h200
    a100 = plan_with(tmp_path, QWEN_05B_ACCUM.format(accum=4, extra=""), 80, True)
    assert said(a100)[0].startswith("train.per_device_train_batch_size = 8 with gradient_accumulation_steps = 2: the same 16 rows"), a100
    assert said(plan_with(tmp_path, QWEN_05B_ACCUM.format(accum=3, extra=""), 141, True))[0].startswith(
        "train.per_device_train_batch_size = 12 with gradient_accumulation_steps = 1")
    assert not said(plan_with(tmp_path, QWEN_05B_ACCUM.format(accum=3, extra=""), 80, True))  # 12 rows do not fit 80 GB
    assert not said(plan_with(tmp_path, QWEN_05B_ACCUM.format(accum=1, extra=""), 141, True))
    assert not said(plan_with(tmp_path, QWEN_05B_ACCUM.format(accum=4, extra="packing = false"), 141, True))
    assert not said(plan_with(tmp_path, QWEN_05B_ACCUM.format(accum=4, extra=""), 20, True))  # nothing larger fits
    assert not said(plan_in_process(tmp_path, QWEN_05B_ACCUM.format(accum=4, extra=""), None))


def _patch_importing_a_renamed_class(model=None, **kw):
    # what liger-kernel 0.8.5's Qwen2.5-VL patch imports, gone from transformers 5 (renamed MultimodalCausalLMOutputWithPast)
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLCausalLMOutputWithPast  # noqa: F401


def _patch_importing_what_exists(model=None, **kw):
    from transformers.models.llama import modeling_llama  # noqa: F401 -- a submodule, named in the from-import
    from transformers.models.llama.modeling_llama import LlamaModel  # noqa: F401


def test_a_liger_patch_that_cannot_import_its_model_classes_is_found_before_the_trainer_calls_it():
    from swiftslurm.train.kernels.choose import liger_import_problem

    table = {"qwen2_5_vl": _patch_importing_a_renamed_class, "llama": _patch_importing_what_exists}
    problem = liger_import_problem("qwen2_5_vl", table)
    assert problem is not None and problem.startswith("ImportError") and "Qwen2_5_VLCausalLMOutputWithPast" in problem
    assert liger_import_problem("llama", table) is None
    assert liger_import_problem("gpt2", table) is None  # no patch: the type rule (fit_liger_to_model) speaks


def test_liger_that_cannot_import_is_off_under_auto_and_refused_when_asked_for():
    from swiftslurm.train.kernels.choose import LIGER_ALL, LIGER_FAST, KernelError, fit_liger_to_model

    problem = "ImportError: cannot import name 'LigerQwen2_5_VLCausalLMOutputWithPast'"
    config, why = fit_liger_to_model("auto", LIGER_FAST, "auto: ...", "qwen2_5_vl", problem)
    assert config is None and why.startswith("auto: off (Liger's patch for model type 'qwen2_5_vl' fails to import") \
        and "LigerQwen2_5_VLCausalLMOutputWithPast" in why, why
    with pytest.raises(KernelError, match="cannot run this model"):
        fit_liger_to_model(True, LIGER_ALL, "on in the spec", "qwen2_5_vl", problem)
    assert fit_liger_to_model("auto", LIGER_FAST, "auto: ...", "qwen2_5_vl", None) == (LIGER_FAST, "auto: ...")
