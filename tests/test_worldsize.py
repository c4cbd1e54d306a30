"""Resuming on another data-parallel world size: the checkpoint becomes a verified universal sibling, and the losses
after the move follow the uninterrupted run's.

Pure: ``plan_load`` (load as is, convert, refuse) and ``writer_layout`` (meta first, else the shard files).
Real tool: a checkpoint DeepSpeed cannot convert is refused with DeepSpeed's reason and the manual way.
Slow (real trainer, gloo, CPU), one chain through ZeRO-2 and ZeRO-3, the global batch always 4 (the demo's 36 packed
rows are exactly 9 steps per epoch, so no step is a short epoch tail):
  ref    ZeRO-2, 2 ranks x accumulation 2, 16 steps, checkpoints 4, 8, 12, 16
  2 -> 4 a new output dir holding only ref's checkpoint-4; 4 ranks x accumulation 1 to step 8
  4 -> 2 the same dir, 2 ranks x accumulation 2 to step 12, from the checkpoint-8 the 4 ranks wrote
  2 -> 3 a new dir, ZeRO-3 on 2 ranks from ref's checkpoint-8 to step 12
  3: 2 -> 4 that dir, ZeRO-3 on 4 ranks from its own checkpoint-12 (ZeRO-3 shards) to step 16
The losses of steps 5-16 stay within 1e-3 of ref's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomllib
from test_train import losses, quickstart_spec, to_toml

from swiftslurm import checkpoint as ck
from swiftslurm.checkpoint.formats import universal as ucp
from swiftslurm.train.launch import launch


def test_plan_load_decides_as_is_convert_or_refuse():
    L = ucp.Layout
    assert ucp.plan_load(L(2, 2), L(2, 2)).action == "as_is"
    assert ucp.plan_load(L(2, 0), L(8, 0)).action == "as_is"  # ZeRO-0: the whole optimizer is in mp_rank_00
    bf16_optimizer = ucp.plan_load(L(2, 0, partitioned=True), L(8, 0))  # ... except DeepSpeed's bf16 optimizer
    assert bf16_optimizer.action == "refuse" and "bf16 optimizer" in bf16_optimizer.reason
    for writer, reader in ((L(2, 2), L(4, 2)), (L(4, 2), L(2, 2)), (L(2, 2), L(2, 3)), (L(8, 3), L(4, 3))):
        assert ucp.plan_load(writer, reader).action == "convert", (writer, reader)
    refused = {(w, r): ucp.plan_load(w, r) for w, r in ((L(2, 0), L(4, 2)), (L(2, 2), L(4, 0)), (L(2, 2, 2), L(4, 2)),
                                                       (L(2, -1), L(4, 2)))}
    assert all(p.action == "refuse" and p.reason for p in refused.values())
    assert "issue 7200" in refused[(L(2, 0), L(4, 2))].reason
    out_of_zero3 = ucp.plan_load(L(2, 3), L(2, 2))  # the tool's ZeRO-3 layout loads only into ZeRO-3
    assert out_of_zero3.action == "refuse" and "resume_weights_only = true" in out_of_zero3.reason
    assert ucp.plan_load(L(2, 2), L(4, 3)).action == "convert"
    assert "tensor/pipeline" in refused[(L(2, 2, 2), L(4, 2))].reason


def test_writer_layout_reads_the_meta_else_the_shard_files():
    files = {f"global_step5/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt": {} for r in range(3)}
    files["global_step5/mp_rank_00_model_states.pt"] = {}
    assert ucp.writer_layout({"dp_world_size": 4, "zero_stage": 3}, files) == ucp.Layout(4, 3)
    assert ucp.writer_layout({"dp_world_size": 4, "zero_stage": 0}, files).partitioned
    old = {"world_size": 3, "spec_fingerprint": {"deepspeed.zero_optimization.stage": 2}}  # written before dp_world_size
    assert ucp.writer_layout(old, files) == ucp.Layout(3, 2)
    assert ucp.writer_layout({"world_size": 2}, {"global_step5/mp_rank_00_model_states.pt": {}}) == ucp.Layout(2, 0)
    assert ucp.writer_layout({}, files).zero_stage == -1  # shards but no stage recorded: refused by plan_load


def test_a_checkpoint_deepspeed_cannot_convert_is_refused_with_its_reason_and_the_manual_way(tmp_path):
    staging = ck.prepare_staging(tmp_path / "run", 3)
    (staging / "global_step3").mkdir()
    (staging / "global_step3" / "mp_rank_00_model_states.pt").write_bytes(b"not a torch file")
    (staging / "trainer_state.json").write_text("{}")
    src = tmp_path / "run" / "checkpoint-3"
    ck.commit(staging, src, algo="xxh3", meta={"step": 3})
    plan = ucp.plan_load(ucp.Layout(2, 2), ucp.Layout(4, 2))
    with pytest.raises(ucp.CheckpointNotConvertible) as err:
        ucp.convert(src, tmp_path / "new", plan, algo="xxh3", timeout_s=300)
    msg = err.value.message()
    assert "could not convert checkpoint-3" in msg and "optim_states" in msg, msg  # DeepSpeed's own reason
    assert "ds_convert --input_folder" in msg and "2 data-parallel rank(s) at ZeRO-2" in msg
    assert not (tmp_path / "new" / "universal" / "checkpoint-3").exists()  # nothing that looks like a checkpoint


def test_a_step_counter_shared_by_sub_groups_is_untied_before_training():
    """DeepSpeed's ZeRO-3 universal load hands every sub-group's state the same ``step`` tensor; torch's Adam then
    advances it once per sub-group per step (bias correction off). ``untie_step_counters`` gives each its own."""
    import torch

    from swiftslurm.train.resume.worldsize import untie_step_counters

    def adam_after_load():
        params = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))]
        opt = torch.optim.AdamW([{"params": [params[0]]}, {"params": [params[1]]}], lr=0.1, foreach=False)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        shared = torch.tensor(4.0)  # as stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3 assigns it
        for p in params:
            opt.state[p]["step"] = shared
        return opt, params

    opt, params = adam_after_load()
    opt.step()
    assert [float(opt.state[p]["step"]) for p in params] == [6.0, 6.0]  # the bug: one step counted twice

    opt, params = adam_after_load()
    assert untie_step_counters(opt) == 1 and untie_step_counters(opt) == 0
    opt.step()
    assert [float(opt.state[p]["step"]) for p in params] == [5.0, 5.0]

    class ZeroWrapper:  # DeepSpeed's optimizer holds the torch one as .optimizer
        def __init__(self, inner):
            self.optimizer = inner

    opt, params = adam_after_load()
    assert untie_step_counters(ZeroWrapper(opt)) == 1 and untie_step_counters(None) == 0


def _spec(tmp: Path, name: str, stage: str, ranks: int, max_steps: int, out: Path | None = None, **train) -> tuple[str, Path]:
    spec, default_out = quickstart_spec(tmp, name, logging_steps=1, max_steps=max_steps, save_steps=4, deepspeed=stage,
                                        per_device_train_batch_size=1, gradient_accumulation_steps=4 // ranks, **train)
    data = tomllib.loads(Path(spec).read_text())
    data["slurm"]["tasks_per_node"] = ranks
    data["checkpoint"].update(keep=4, allow_spec_change=True)  # micro-batch/accumulation change with the world size
    if out is not None:
        data["job"]["output_dir"] = str(out)
    Path(spec).write_text(to_toml(data))
    return spec, Path(data["job"]["output_dir"])


def _run(spec: str, out: Path, ranks: int, **kw) -> str:
    procs = launch(spec, str(out), nprocs=ranks, timeout_s=900, **kw)
    for rank, p in enumerate(procs):
        assert p.returncode == 0, f"rank {rank} of {ranks} failed:\n{p.stdout[-6000:]}"
    return procs[0].stdout


@pytest.mark.slow
def test_resume_on_another_world_size_follows_the_uninterrupted_losses(tmp_path):
    """One chain through every conversion: ZeRO-2 2 -> 4 -> 2 ranks, ZeRO-2 -> ZeRO-3, then ZeRO-3's own shards 2 -> 4."""
    spec, ref = _spec(tmp_path, "ref", "zero2", 2, 16)
    _run(spec, ref, 2)
    want = losses(ref)
    moved = tmp_path / "moved"
    moved.mkdir()
    before = sorted(str(p.relative_to(ref)) for p in ref.rglob("*"))
    for killed in (4, 2):  # conversions killed midway left staging dirs: never read, cleaned after the next one
        (moved / "universal" / f".staging-checkpoint-{killed}" / "global_step4_universal").mkdir(parents=True)
        (moved / "universal" / f".staging-checkpoint-{killed}" / "trainer_state.json").write_text("{")

    # a new run on 4 ranks starts from the 2-rank run's checkpoint (train.resume_from): converted into its own dir
    spec4, _ = _spec(tmp_path, "moved4", "zero2", 4, 8, out=moved, resume_from=str(ref / "checkpoint-4"))
    stdout = _run(spec4, moved, 4, resume="newest")
    assert sorted(str(p.relative_to(ref)) for p in ref.rglob("*")) == before  # the source is only read
    assert "checkpoint-4 was written by 2 data-parallel rank(s) at ZeRO-2; this run has 4" in stdout, stdout[-4000:]
    assert f"resuming at step 4 on 4 data-parallel rank(s) at ZeRO-2 from the universal checkpoint {moved}/universal/checkpoint-4" in stdout
    sibling = ck.verify(moved / "universal" / "checkpoint-4")
    assert sibling.ok and sibling.manifest.meta["universal"]["writer"] == {"dp_world_size": 2, "zero_stage": 2, "mp_degree": 1}
    assert sorted(p.name for p in (moved / "universal").iterdir()) == ["checkpoint-4", "latest"]
    meta8 = ck.read_manifest(moved / "checkpoint-8").meta
    assert (meta8["dp_world_size"], meta8["zero_stage"]) == (4, 2)

    spec2, _ = _spec(tmp_path, "moved2", "zero2", 2, 12, out=moved)
    stdout = _run(spec2, moved, 2, resume="newest")
    assert "checkpoint-8 was written by 4 data-parallel rank(s) at ZeRO-2; this run has 2" in stdout, stdout[-4000:]
    assert sorted(p.name for p in (moved / "universal").glob("checkpoint-*")) == ["checkpoint-8"]  # the older one went

    said: list[str] = []  # a later start finds the verified sibling of the same source and reuses it
    plan = ucp.plan_load(ucp.Layout(4, 2), ucp.Layout(2, 2))
    again, _ = ucp.convert(moved / "checkpoint-8", moved, plan, algo="xxh3", timeout_s=60, log=said.append)
    assert again == moved / "universal" / "checkpoint-8" and "reusing the universal checkpoint" in said[0]

    got = losses(moved)
    assert sorted(got) == list(range(5, 13)), got  # resumed at 5, then at 9: no step lost or repeated
    for step in range(5, 13):
        assert got[step] == pytest.approx(want[step], abs=1e-3), (step, got, want)
    rows = [json.loads(line) for line in (moved / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(r["step"] >= 5 for r in rows)

    # ZeRO-2 -> ZeRO-3 (the way out of an OOM): the sibling answers ZeRO-3's loader too (its model-states name, the
    # step and param groups where ZeRO-3 reads them); DeepSpeed's loader asserted on both before
    up = tmp_path / "zero3"
    spec3, _ = _spec(tmp_path, "zero3", "zero3", 2, 12, out=up, resume_from=str(ref / "checkpoint-8"))
    stdout = _run(spec3, up, 2, resume="newest")
    assert "checkpoint-8 was written by 2 data-parallel rank(s) at ZeRO-2; this run has 2 data-parallel rank(s) at ZeRO-3" in stdout
    got = losses(up)
    assert sorted(got) == [9, 10, 11, 12], got
    for step in got:
        assert got[step] == pytest.approx(want[step], abs=1e-3), (step, got, want)

    # ZeRO-3's own shards on another world size: the 2 ZeRO-3 ranks' checkpoint-12 resumed on 4 ranks to step 16
    spec34, _ = _spec(tmp_path, "zero3-4", "zero3", 4, 16, out=up)
    stdout = _run(spec34, up, 4, resume="newest")
    assert "checkpoint-12 was written by 2 data-parallel rank(s) at ZeRO-3; this run has 4" in stdout, stdout[-4000:]
    sibling = ck.verify(up / "universal" / "checkpoint-12")
    assert sibling.ok and sibling.manifest.meta["universal"]["writer"] == {"dp_world_size": 2, "zero_stage": 3, "mp_degree": 1}
    assert (ck.read_manifest(up / "checkpoint-16").meta["dp_world_size"], ck.read_manifest(up / "checkpoint-16").meta["zero_stage"]) == (4, 3)
    got = losses(up)
    assert sorted(got) == list(range(9, 17)), got
    for step in range(13, 17):
        assert got[step] == pytest.approx(want[step], abs=1e-3), (step, got, want)
