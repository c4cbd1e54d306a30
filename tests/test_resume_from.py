"""train.resume_from on CPU with the real trainer (2 ranks, DeepSpeed ZeRO-2, tiny Llama, constant lr):

  reference  the quickstart spec, 10 steps, checkpoints at 5 and 10
  new run    its own output dir, resume_from = reference/checkpoint-5: continues at step 6 with the reference's
             losses; a walltime stop at step 7, then the restart resumes from ITS OWN checkpoint-7, not resume_from
  weights    resume_weights_only from reference/checkpoint-10: step 1 again, on the trained weights
  damaged    a resume_from whose shard was overwritten: every rank exits 5 naming the file, no traceback
  imported   a bare HF Trainer + DeepSpeed script's checkpoint-3 (swiftslurm import, then resume_from on the
             HF dir itself): continues at step 4 with the bare run's losses
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_train import losses, quickstart_spec, run

from swiftslurm import checkpoint as ck
from swiftslurm.train.launch import free_port, launch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data" / "alpaca_demo.jsonl"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    spec, out = quickstart_spec(tmp, "reference", logging_steps=1, max_steps=10, save_steps=5)
    run(spec, out)
    return out, tmp


def test_resume_from_another_run_continues_there_and_a_requeue_resumes_its_own(reference):
    ref, tmp = reference
    before = sorted(p.name for p in ref.iterdir())
    spec, out = quickstart_spec(tmp, "continued", logging_steps=1, max_steps=10, save_steps=5,
                                resume_from=str(ref / "checkpoint-5"))
    first = run(spec, out, resume="newest", stop_at_step=2)  # as `swiftslurm run` does; a walltime stop after 2 steps
    assert [r["global_step"] for r in first] == [7, 7] and first[0]["stopped_for_requeue"]
    assert f"every rank (2) resumes from {ref / 'checkpoint-5'}" in first[0]["stdout"]
    got, want = losses(out), losses(ref)
    assert sorted(got) == [6, 7]  # step K+1 first: the data position and step counter came with the checkpoint
    for step in (6, 7):
        assert got[step] == pytest.approx(want[step], rel=1e-4), (step, got, want)
    assert ck.verify(out / "checkpoint-7").ok and sorted(p.name for p in ref.iterdir()) == before

    second = run(spec, out, resume="newest")  # the requeue: its own newest checkpoint, not resume_from again
    assert f"every rank (2) resumes from {out / 'checkpoint-7'}" in second[0]["stdout"]
    assert second[0]["global_step"] == 10
    got = losses(out)
    for step in (8, 9, 10):
        assert got[step] == pytest.approx(want[step], rel=1e-4), (step, got, want)


def test_a_damaged_resume_from_is_refused_naming_the_file(reference):
    ref, tmp = reference
    damaged = tmp / "damaged" / "checkpoint-5"
    shutil.copytree(ref / "checkpoint-5", damaged)
    shard = damaged / "global_step5" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    spec, out = quickstart_spec(tmp, "refused", max_steps=10, resume_from=str(damaged))
    procs = launch(spec, str(out), nprocs=2, resume="newest", timeout_s=300)
    for rank, p in enumerate(procs):
        assert p.returncode == 5, f"rank {rank}: exit {p.returncode}\n{p.stdout[-3000:]}"
        assert "train.resume_from is damaged" in p.stdout and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in p.stdout
        assert "checksum mismatch" in p.stdout and "Traceback" not in p.stdout
    assert not list(out.glob("checkpoint-*"))


def test_weights_only_starts_at_step_1_from_the_trained_weights(reference):
    ref, tmp = reference
    spec, out = quickstart_spec(tmp, "weights", logging_steps=1, max_steps=2, save_steps=5,
                                resume_from=str(ref / "checkpoint-10"), resume_weights_only=True)
    results = run(spec, out, resume="newest")
    assert [r["global_step"] for r in results] == [2, 2]
    got, want = losses(out), losses(ref)
    assert sorted(got) == [1, 2]  # step 0: a fresh optimizer, schedule and data order
    # the same first batch as the reference's step 1 (fresh data order, same seed), on the weights of step 10
    assert got[1] < 0.8 * want[1], (got, want)
    assert ck.verify(out / "checkpoint-2").ok


def bare_hf_run(out: Path, steps: int, save_steps: int) -> None:
    port = free_port()
    env = {**os.environ, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "bare_hf_trainer.py"), str(out), str(DATA), str(steps), str(save_steps)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    for r, p in enumerate(procs):
        stdout, _ = p.communicate(timeout=300)
        assert p.returncode == 0, f"bare rank {r}:\n{stdout[-4000:]}"


def test_a_bare_hf_trainer_checkpoint_is_imported_and_resumed_from(tmp_path):
    bare = tmp_path / "bare"
    bare_hf_run(bare, steps=6, save_steps=3)
    hf_ckpt = bare / "checkpoint-3"
    assert (hf_ckpt / "global_step3").is_dir() and not (hf_ckpt / "manifest.json").exists()

    proc = subprocess.run([sys.executable, "-m", "swiftslurm", "import", str(hf_ckpt), "--into", str(tmp_path / "imported"), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    facts = json.loads(proc.stdout)
    assert (facts["kind"], facts["step"], facts["world_size"], facts["zero_stage"], facts["deepspeed"]) == ("hf-trainer", 3, 2, 2, True)
    assert facts["dtype"] == "float32" and ck.verify(facts["checkpoint"]).ok
    assert ck.read_manifest(facts["checkpoint"]).meta["source"]["path"] == str(hf_ckpt)

    # resume_from takes the HF dir itself: imported on the fly into the new run's dir, then resumed at step 4
    spec, out = quickstart_spec(tmp_path, "from-bare", logging_steps=1, max_steps=6, save_steps=3, packing=False,
                                resume_from=str(hf_ckpt))
    results = run(spec, out, resume="newest")
    assert results[0]["global_step"] == 6
    assert ck.verify(out / "resume-source" / "checkpoint-3").ok
    got = losses(out)
    want = {json.loads(line)["step"]: json.loads(line)["loss"] for line in (bare / "steps.jsonl").read_text().splitlines()}
    assert sorted(got) == [4, 5, 6]
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(want[step], rel=1e-3), (step, got, want)
