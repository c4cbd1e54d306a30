"""``checkpoint.async_save``: what plan decides and validate refuses, and the two pieces the background save is built
from (the host snapshot that writes a synchronous save's bytes, the one save in flight). The trainer's own async saves
run in tests/test_train.py (the bytes of a synchronous save, a walltime stop waiting for the commit) and
tests/test_fault_injection.py (killed mid-way, the previous checkpoint stays the newest verified). Issue #54."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest
import tomllib
import torch
from test_sizing import cli, spec_file

from swiftslurm import checkpoint as ck
from swiftslurm.node.banner import banner_rows
from swiftslurm.plan import make_plan
from swiftslurm.slurm.distenv import derive
from swiftslurm.spec import parse_spec
from swiftslurm.train.save.background import BackgroundSave
from swiftslurm.train.save.snapshot import StagedWrites, snapshot

FULL_8B = ('model = "meta-llama/Meta-Llama-3-8B"\ntrain_type = "full"\nbf16 = true\ndeepspeed = "zero2"\n'
           "[train.model_shape]\nhidden_size = 4096\nnum_layers = 32\nheads = 32\nkv_heads = 8\n"
           "intermediate_size = 14336\nvocab_size = 128256\ntie_word_embeddings = false")


def planned(tmp_path: Path, slurm: str, tables: str = ""):
    path = spec_file(tmp_path, FULL_8B, slurm=slurm)
    toml = path.read_text() + tables
    return make_plan(parse_spec(toml), tomllib.loads(toml), base_dir=str(tmp_path), source=str(path))


def test_auto_is_off_with_its_reason_and_true_is_on_where_the_host_copy_fits(tmp_path):
    gpu = planned(tmp_path, "nodes = 1\ngpus_per_node = 8")
    [task] = gpu.tasks  # off until a GPU check shows the bytes of a synchronous save (docs/benchmarks.md)
    assert task.spec.checkpoint.async_save is False and task.decisions["checkpoint.async_save"].startswith("off (auto)")
    assert "checkpoint.async_save = true turns it on" in task.decisions["checkpoint.async_save"]
    chosen = planned(tmp_path, 'nodes = 1\ngpus_per_node = 8\nmem = "512G"', "[checkpoint]\nasync_save = true\n")
    assert chosen.tasks[0].spec.checkpoint.async_save is True and "checkpoint.async_save" not in chosen.tasks[0].decisions
    cpu = planned(tmp_path, "nodes = 1\ntasks_per_node = 2")
    assert cpu.tasks[0].spec.checkpoint.async_save is False
    assert cpu.tasks[0].decisions["checkpoint.async_save"].startswith("off (auto): a CPU job")
    # 8B full fine-tune on 8 ranks a node: 12 bytes of optimizer state a parameter over the node, plus the 16-bit weights
    tight = planned(tmp_path, 'nodes = 1\ngpus_per_node = 8\nmem = "64G"')
    why = tight.tasks[0].decisions["checkpoint.async_save"]
    assert tight.tasks[0].spec.checkpoint.async_save is False and why.startswith("off (auto)") and "slurm.mem = 64G" in why
    staged_gib = float(why.split("stages ")[1].split(" GiB")[0])
    assert 100 < staged_gib < 120, why  # 8.0e9 params x (12 + 2) bytes
    rows = dict(banner_rows(derive(dict(SLURM_JOB_ID="1", SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_NODELIST="n1",
                                        SLURM_JOB_NODELIST="n1", SLURM_LOCALID="0", SLURM_NNODES="1")),
                            tight.tasks[0].spec, "out", "train", "-", {}, tight.tasks[0].decisions))
    assert rows["background saves"] == why


def test_true_where_the_host_copy_cannot_fit_is_refused_at_validate(tmp_path):
    path = spec_file(tmp_path, FULL_8B, slurm='nodes = 1\ngpus_per_node = 8\nmem = "64G"')
    path.write_text(path.read_text() + "[checkpoint]\nasync_save = true\n")
    run = cli(path, "validate")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    text = run.stdout + run.stderr
    assert "checkpoint.async_save" in text and "slurm.mem = 64G" in text and "HINT" in text, text
    assert not (tmp_path / "out").exists()


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_snapshot_writes_the_bytes_torch_save_wrote_at_that_moment(tmp_path):
    base = torch.randn(10, 4)
    state = {"weights": base, "view": base[2:5], "transposed": base.t(), "param": torch.nn.Parameter(torch.randn(3)),
             "optimizer": {"state": {0: {"exp_avg": torch.zeros(3), "step": torch.tensor(4.0)}},
                           "param_groups": [{"lr": 0.1, "params": [0]}]},
             "bf16": torch.ones(7, dtype=torch.bfloat16), "empty": torch.empty(0), "grad": torch.randn(2, requires_grad=True)}
    (tmp_path / "sync").mkdir()
    (tmp_path / "async").mkdir()
    torch.save(state, tmp_path / "sync" / "shard.pt")
    snap = snapshot(state)
    base.add_(1)  # training goes on: the snapshot keeps the step's values, shared storages still shared
    state["optimizer"]["param_groups"][0]["lr"] = 0.2
    snap.save(str(tmp_path / "async" / "shard.pt"))
    assert _digest(tmp_path / "async" / "shard.pt") == _digest(tmp_path / "sync" / "shard.pt")
    assert snap.nbytes == (40 + 3 + 3 + 1) * 4 + 7 * 2 + 2 * 4  # each storage copied once


def test_a_tensor_a_copy_cannot_reproduce_is_written_at_once(tmp_path):
    class Engine:
        zipfile_serialization = True

        def save(self, state, path):
            torch.save(state, path)

    staged = StagedWrites(Engine())
    staged.save({"sparse": torch.eye(3).to_sparse()}, str(tmp_path / "a.pt"))
    staged.save({"plain": torch.eye(3)}, str(tmp_path / "b.pt"))
    assert (tmp_path / "a.pt").exists() and not (tmp_path / "b.pt").exists() and staged.direct == [str(tmp_path / "a.pt")]
    staged.write_all()
    assert torch.equal(torch.load(tmp_path / "b.pt")["plain"], torch.eye(3))


def test_one_save_in_flight_and_its_error_reaches_the_training_thread():
    saves, gate = BackgroundSave(), threading.Event()
    saves.submit(lambda: gate.wait(10) and {"checkpoint_step": 5})
    with pytest.raises(RuntimeError, match="in flight"):
        saves.submit(lambda: None)
    assert saves.take_done() == []  # not finished: nothing is waited for
    gate.set()
    assert saves.wait() >= 0 and saves.take_done() == [{"checkpoint_step": 5}]

    def fails():
        raise OSError("No space left on device")

    saves.submit(fails)
    with pytest.raises(OSError, match="No space left"):
        saves.wait()
    assert not saves.in_flight


def test_rank_0_waits_for_every_rank_s_hashes_and_names_the_missing(tmp_path):
    staging = ck.prepare_staging(tmp_path, 4)
    ck.publish_rank_hashes(staging, 1, {"rng_state_1.pth": {"size": 3, "checksum": "x"}})
    with pytest.raises(TimeoutError, match=r"ranks \[2\] did not finish"):
        ck.collect_rank_hashes(staging, 3, timeout_s=0.2)
    ck.publish_rank_hashes(staging, 2, {"rng_state_2.pth": {"size": 3, "checksum": "y"}})
    assert set(ck.collect_rank_hashes(staging, 3, timeout_s=1)) == {"rng_state_1.pth", "rng_state_2.pth"}
    assert list(staging.iterdir()) == []  # the hand-over is not part of the checkpoint


def test_a_hand_over_file_that_is_not_a_hash_record_is_refused_not_trusted(tmp_path):
    from swiftslurm.fsutil import Unreadable

    staging = ck.prepare_staging(tmp_path, 5)
    folder = staging / ".rank-hashes"
    folder.mkdir()
    (folder / "rank-1.json").write_text("[1, 2, 3]")  # a JSON list where rank 1's {file: hash} belongs
    with pytest.raises(Unreadable):
        ck.collect_rank_hashes(staging, 2, timeout_s=1)
    (folder / "rank-1.json").unlink()
    (folder / "rank-1.json").symlink_to("/etc/passwd")  # a link out of the staging dir is never followed
    with pytest.raises(Unreadable):
        ck.collect_rank_hashes(staging, 2, timeout_s=1)
