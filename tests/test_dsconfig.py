"""DeepSpeed presets and the rules of SPEC.md (pure: no DeepSpeed import needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swiftslurm import dsconfig
from swiftslurm.errors import SpecError
from swiftslurm.spec import validate_spec

GOLDEN = Path(__file__).parent / "golden" / "ds"
PRESETS = ["zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "zero3_nvme", "zero2_fast"]


def make_spec(deepspeed="zero2", overrides=None, bf16=True, fp16=False, nodes=1, tasks=2, micro=2, accum=4):
    data = {
        "slurm": {"nodes": nodes, "tasks_per_node": tasks},
        "train": {"model": "tiny-llama", "dataset": ["d.jsonl"], "deepspeed": deepspeed, "bf16": bf16,
                  "fp16": fp16, "per_device_train_batch_size": micro, "gradient_accumulation_steps": accum},
    }
    if overrides is not None:
        data["deepspeed"] = overrides
    return validate_spec(data)


def test_the_eight_presets_ship():
    assert dsconfig.preset_names() == sorted(PRESETS)


def preset_golden(name: str) -> tuple[Path, str]:
    """(golden file, the text the code makes now) of a preset merged for make_spec; tests/update_goldens.py writes it."""
    ds, _ = dsconfig.build_for_spec(make_spec(name))
    return GOLDEN / f"{name}.json", json.dumps(ds, indent=2, sort_keys=True) + "\n"


@pytest.mark.parametrize("name", PRESETS)
def test_preset_merged_output_matches_golden(name):
    """Compares only: a change is written by `python -m tests.update_goldens` and reviewed in the diff."""
    ds, warnings = dsconfig.build_for_spec(make_spec(name))
    path, _ = preset_golden(name)
    assert ds == json.loads(path.read_text()), f"{path} differs; if the change is meant: python -m tests.update_goldens, then review the diff"
    assert warnings == []
    assert dsconfig.ALLOW_BOTH_OFFLOADS not in ds


def test_spec_md_values():
    z3 = dsconfig.build_for_spec(make_spec("zero3"))[0]["zero_optimization"]
    assert z3["stage3_gather_16bit_weights_on_model_save"] is True
    assert z3["contiguous_gradients"] is True and z3["stage3_max_live_parameters"] == 1e9
    off = dsconfig.build_for_spec(make_spec("zero2_offload"))[0]["zero_optimization"]["offload_optimizer"]
    assert off == {"device": "cpu", "pin_memory": True, "buffer_count": 4}
    nvme = dsconfig.build_for_spec(make_spec("zero3_nvme"))[0]
    assert nvme["aio"]["block_size"] == 1048576
    fast = dsconfig.build_for_spec(make_spec("zero2_fast"))[0]["zero_optimization"]
    assert fast["allgather_bucket_size"] == 2e8


def test_injection_uses_world_size_and_precision():
    ds, _ = dsconfig.build_for_spec(make_spec("zero2", nodes=2, tasks=3, micro=5, accum=7, bf16=False, fp16=True))
    assert ds["train_batch_size"] == 5 * 6 * 7
    assert ds["train_micro_batch_size_per_gpu"] == 5 and ds["gradient_accumulation_steps"] == 7
    assert ds["wall_clock_breakdown"] is False and ds["zero_allow_untested_optimizer"] is True
    assert ds["bf16"] == {"enabled": False} and ds["fp16"]["enabled"] is True


def test_overrides_deep_merge_over_preset():
    ds, _ = dsconfig.build_for_spec(make_spec("zero2", {"zero_optimization": {"reduce_bucket_size": 123},
                                                        "steps_per_print": 7}))
    assert ds["zero_optimization"]["reduce_bucket_size"] == 123
    assert ds["zero_optimization"]["stage"] == 2 and ds["zero_optimization"]["contiguous_gradients"] is True
    assert ds["steps_per_print"] == 7


def test_throughput_timer_does_not_sync_unless_a_config_asks(tmp_path):
    """DeepSpeed's throughput timer syncs the device twice a step by default; ours does not, under every preset and
    user file, and a [deepspeed] table or a user file that sets it wins (the rest of its section kept)."""
    for name in dsconfig.preset_names():
        ds, _ = dsconfig.build_for_spec(make_spec(name))
        assert ds["timers"] == {"throughput": {"synchronized": False}}, name
    ds, _ = dsconfig.build_for_spec(make_spec("zero2", {"timers": {"throughput": {"synchronized": True, "enabled": True}}}))
    assert ds["timers"] == {"throughput": {"synchronized": True, "enabled": True}}
    f = tmp_path / "my_ds.json"
    f.write_text(json.dumps({"zero_optimization": {"stage": 2}, "timers": {"throughput": {"synchronized": True}}}))
    ds, _ = dsconfig.build_for_spec(make_spec(str(f)))
    assert ds["timers"] == {"throughput": {"synchronized": True}}


def test_optimizer_type_is_dropped_with_a_warning():
    ds, warnings = dsconfig.build_for_spec(make_spec("zero2", {"optimizer": {"type": "Lamb", "params": {}}}))
    assert "optimizer" not in ds
    assert len(warnings) == 1 and "Lamb" in warnings[0] and "ignored" in warnings[0]


def test_allow_both_offloads_key_lets_both_through():
    both = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
    ds, _ = dsconfig.build_for_spec(make_spec("zero3", {**both, "swiftslurm_allow_both_offloads": True}))
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert "swiftslurm_allow_both_offloads" not in ds


REFUSED = [
    # (preset, [deepspeed] overrides, bf16, TOML path named, words in the reason)
    ("zero2", {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, True,
     "deepspeed.zero_optimization.offload_optimizer", "stage 3"),
    ("zero3", {"zero_optimization": {"offload_param": {"device": "nvme"}}}, False,
     "deepspeed.zero_optimization.offload_param", "bf16"),
    ("zero3_nvme", {}, False, "deepspeed.zero_optimization.offload_optimizer", "bf16"),
    ("zero3", {"zero_optimization": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}, True,
     "deepspeed.zero_optimization.offload_param", "both on"),
    ("zero3_offload", {"swiftslurm_allow_both_offloads": False}, True,
     "deepspeed.zero_optimization.offload_param", "both on"),
    ("zero2", {"zero_optimization": {"stage": 5}}, True, "deepspeed.zero_optimization.stage", "unknown ZeRO stage"),
    ("zero2", {"zero_optimization": {"offload_param": {"device": "cpu"}}}, True,
     "deepspeed.zero_optimization.offload_param", "stage 3"),
    ("zero0", {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, True,
     "deepspeed.zero_optimization.offload_optimizer", "stage 1"),
]


@pytest.mark.parametrize("preset,overrides,bf16,path,reason", REFUSED)
def test_refused_combinations(preset, overrides, bf16, path, reason):
    with pytest.raises(SpecError) as info:
        dsconfig.build_for_spec(make_spec(preset, overrides, bf16=bf16))
    paths = [p.path for p in info.value.problems]
    assert path in paths
    assert any(reason in p.what for p in info.value.problems if p.path == path)


USER_FILES = [
    ("not json {", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"zero_optimization": {"stage": 1}}', "stage to 2 or 3"),
    ('{"train_batch_size": 8}', "stage to 2 or 3"),
    ('{"zero_optimization": {"stage": true}}', "stage to 2 or 3"),
]


@pytest.mark.parametrize("text,reason", USER_FILES)
def test_user_json_refused(tmp_path, text, reason):
    f = tmp_path / "ds.json"
    f.write_text(text)
    with pytest.raises(SpecError) as info:
        dsconfig.load_user_config(f)
    assert [p.path for p in info.value.problems] == ["train.deepspeed"]
    assert reason in info.value.problems[0].what


def test_user_json_missing_file(tmp_path):
    with pytest.raises(SpecError) as info:
        dsconfig.load_user_config(tmp_path / "nope.json")
    assert "not found" in info.value.problems[0].what


def test_user_json_accepted_and_merged(tmp_path):
    f = tmp_path / "my_ds.json"
    f.write_text(json.dumps({"zero_optimization": {"stage": 3, "overlap_comm": True},
                             "optimizer": {"type": "AdamW"}}))
    ds, warnings = dsconfig.build_for_spec(make_spec(str(f), {"zero_optimization": {"overlap_comm": False}}))
    assert ds["zero_optimization"] == {"stage": 3, "overlap_comm": False}
    assert ds["train_batch_size"] == 2 * 2 * 4 and "optimizer" not in ds and warnings


# ---------------------------------------------------------------- NVMe swap: one folder per job and task


def test_nvme_offload_swaps_to_a_folder_of_its_own_under_the_configured_path():
    ds, _ = dsconfig.build_for_spec(make_spec("zero3_nvme", overrides={"zero_optimization": {"offload_param": {"nvme_path": "/local/nvme"}}}))
    name = dsconfig.nvme_swap_name("4711", 3, "/shared/out/3")
    isolated, folders = dsconfig.isolate_nvme_swap(ds, name)
    zero = isolated["zero_optimization"]
    assert name.startswith("swiftslurm-4711-3-")
    assert zero["offload_optimizer"]["nvme_path"] == f"/tmp/{name}" and zero["offload_param"]["nvme_path"] == f"/local/nvme/{name}"
    assert folders == [f"/tmp/{name}", f"/local/nvme/{name}"]
    assert ds["zero_optimization"]["offload_param"]["nvme_path"] == "/local/nvme"  # pure: the input is untouched
    for key in ("offload_optimizer", "offload_param"):  # nothing else moved
        rest = {k: v for k, v in zero[key].items() if k != "nvme_path"}
        assert rest == {k: v for k, v in ds["zero_optimization"][key].items() if k != "nvme_path"}
    for preset in ("zero2", "zero3_offload"):  # no NVMe offload: unchanged, no folders
        plain, _ = dsconfig.build_for_spec(make_spec(preset))
        assert dsconfig.isolate_nvme_swap(plain, name) == (plain, [])


def test_two_jobs_and_two_sweep_tasks_get_different_swap_folders():
    from swiftslurm.plan import make_plan

    raw = {"job": {"name": "nv", "output_dir": "out"}, "slurm": {"tasks_per_node": 2},
           "train": {"model": "tiny-llama", "dataset": ["d.jsonl"], "deepspeed": "zero3_nvme", "bf16": True},
           "sweep": {"learning_rate": [1e-4, 2e-4]}}
    plan = make_plan(validate_spec(raw), raw, "/work/submit")
    names = set()
    for job_id in ("100", "101"):
        for task, ds in zip(plan.tasks, plan.deepspeed, strict=True):
            _, folders = dsconfig.isolate_nvme_swap(ds, dsconfig.nvme_swap_name(job_id, task.index, task.output_dir))
            names.add(folders[0])
    assert len(names) == 4  # two jobs x two tasks, all apart
    # under the local executor sweep tasks may share a job id and have no array task id: the output dir separates them
    local = {dsconfig.nvme_swap_name("local-7", None, t.output_dir) for t in plan.tasks}
    assert len(local) == 2 and all("/" not in n for n in local)
    assert "/" not in dsconfig.nvme_swap_name("a/../b", None, "/o")


def test_swap_cleanup_removes_this_ranks_files_and_keeps_other_ranks(tmp_path):
    from swiftslurm.train import nvme_swap

    folder = tmp_path / "swiftslurm-1-abc"
    for rel in ("zero_stage_3/bfloat16params/rank0/p.swp", "zero_stage_3/bfloat16params/rank1/p.swp",
                "zero_stage_3/optimizer/rank0/o.swp", "zero_stage_3/optimizer/rank1/o.swp"):
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(b"x")
    other_job = tmp_path / "swiftslurm-2-def" / "zero_stage_3" / "bfloat16params" / "rank0"
    other_job.mkdir(parents=True)
    nvme_swap.cleanup([str(folder)], rank=0)
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*.swp")) == [
        "zero_stage_3/bfloat16params/rank1/p.swp", "zero_stage_3/optimizer/rank1/o.swp"]
    nvme_swap.cleanup([str(folder), str(tmp_path / "absent")], rank=1)
    assert not folder.exists() and other_job.is_dir()


@pytest.mark.parametrize("name", PRESETS)
def test_one_rank_zero_1_2_presets_drop_contiguous_gradients(name):
    """On one rank a ZeRO-1/2 preset runs without contiguous_gradients (nothing to reduce with, a copy per gradient
    saved); on two or more, and for stage 0/3 and optimizer offload (where DeepSpeed keeps it on anyway), the
    preset is as shipped."""
    preset = dsconfig.load_preset(name)["zero_optimization"]
    one = dsconfig.build_for_spec(make_spec(name, tasks=1))[0]["zero_optimization"]
    many = dsconfig.build_for_spec(make_spec(name, tasks=2))[0]["zero_optimization"]
    assert many.get("contiguous_gradients") == preset.get("contiguous_gradients")
    single_rank_rule = preset["stage"] in (1, 2) and "offload_optimizer" not in preset
    assert one.get("contiguous_gradients") == (False if single_rank_rule else preset.get("contiguous_gradients"))
    assert {k: v for k, v in one.items() if k != "contiguous_gradients"} == \
        {k: v for k, v in many.items() if k != "contiguous_gradients"}
    assert single_rank_rule == (name in ("zero1", "zero2", "zero2_fast"))


def test_what_the_user_says_of_contiguous_gradients_wins_on_one_rank(tmp_path):
    table = dsconfig.build_for_spec(make_spec("zero2", {"zero_optimization": {"contiguous_gradients": True}}, tasks=1))
    assert table[0]["zero_optimization"]["contiguous_gradients"] is True
    own = tmp_path / "ds.json"
    own.write_text(json.dumps({"zero_optimization": {"stage": 2, "contiguous_gradients": True}}))
    assert dsconfig.build_for_spec(make_spec(str(own), tasks=1))[0]["zero_optimization"]["contiguous_gradients"] is True
    own.write_text(json.dumps({"zero_optimization": {"stage": 2}}))  # not said: DeepSpeed's own default, as written
    assert "contiguous_gradients" not in dsconfig.build_for_spec(make_spec(str(own), tasks=1))[0]["zero_optimization"]
    two_nodes = dsconfig.build_for_spec(make_spec("zero2", nodes=2, tasks=1))[0]["zero_optimization"]
    assert two_nodes["contiguous_gradients"] is True  # one rank per node, two ranks
