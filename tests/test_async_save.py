"""``checkpoint.async_save``: what plan decides and validate refuses, and the two pieces the background save is built
from (the host snapshot that writes a synchronous save's bytes, the one save in flight). The trainer's own async saves
run in tests/test_train.py (the bytes of a synchronous save, a walltime stop waiting for the commit) and
tests/test_fault_injection.py (killed mid-way, the previous checkpoint stays the newest verified). Issue #54."""

from __future__ import annotations

import hashlib
import threading
import zipfile
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


def test_auto_is_on_for_gpu_jobs_whose_copy_fits_and_off_for_cpu_jobs_with_the_reason(tmp_path):
    gpu = planned(tmp_path, "nodes = 1\ngpus_per_node = 8")
    [task] = gpu.tasks  # on: a GPU job whose copy fits (slurm.mem unset: the node's memory)
    assert task.spec.checkpoint.async_save is True and task.decisions["checkpoint.async_save"].startswith("on (auto): a GPU job")
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
             "bf16": torch.ones(7, dtype=torch.bfloat16), "empty": torch.empty(0), "grad": torch.randn(2, requires_grad=True),
             "zero3_flat": torch.randn(5)}
    state["zero3_flat"].ds_id = "135_177"  # ZeRO-3 tags its flat fp32 partitions: the attribute is pickled with the tensor
    (tmp_path / "sync").mkdir()
    (tmp_path / "async").mkdir()
    torch.save(state, tmp_path / "sync" / "shard.pt")
    snap = snapshot(state)
    base.add_(1)  # training goes on: the snapshot keeps the step's values, shared storages still shared
    state["optimizer"]["param_groups"][0]["lr"] = 0.2
    snap.save(str(tmp_path / "async" / "shard.pt"))
    assert _digest(tmp_path / "async" / "shard.pt") == _digest(tmp_path / "sync" / "shard.pt")
    assert snap.nbytes == (40 + 3 + 3 + 1 + 5) * 4 + 7 * 2 + 2 * 4  # each storage copied once


def test_strings_the_pickle_shares_with_torch_stay_shared(tmp_path):
    # torch.save's pickle memo goes by identity: a dict key "cpu" (an interned literal) is the very string torch's
    # device tag returns, so a direct save writes the tag as a reference to the key. A copy of the structure must keep
    # that identity (an H100 run found a structure rebuilt from its own pickle lose it)
    state = {"cpu": torch.arange(8), "storage": torch.arange(4.0), "0": [torch.zeros(2)]}
    (tmp_path / "sync").mkdir()
    (tmp_path / "async").mkdir()
    torch.save(state, tmp_path / "sync" / "shard.pt")
    snapshot(state).save(str(tmp_path / "async" / "shard.pt"))
    assert _digest(tmp_path / "async" / "shard.pt") == _digest(tmp_path / "sync" / "shard.pt")


def test_a_gpu_storage_gets_its_device_tag_anew_at_each_use_as_a_direct_save_gives_it(tmp_path, monkeypatch):
    # On a GPU, torch tags a storage "cuda:0" with a new string at every tensor that uses it, and the pickle writes it
    # out each time; one shared tag string would be written once and referenced after (the H100's byte difference).
    # Here the CPU originals are tagged as if on cuda:0 on both sides, by torch's own tagger for that device.
    from swiftslurm.train.save import snapshot as snapmod

    base = torch.randn(6, 6)
    state = {"w": base, "w_t": base.t(), "rows": base[:2], "step": torch.tensor(3.0)}
    originals = {t.untyped_storage()._cdata for t in state.values()}
    cuda0 = torch.device("cuda", 0)

    def as_if_on_gpu(storage):
        untyped = storage._untyped_storage if isinstance(storage, torch.storage.TypedStorage) else storage
        if getattr(untyped, "_cdata", None) in originals:
            return torch.serialization.location_tag(snapmod._OnDevice(cuda0))
        return None

    torch.serialization.register_package(-1, as_if_on_gpu, lambda obj, location: None)
    try:
        (tmp_path / "sync").mkdir()
        (tmp_path / "async").mkdir()
        torch.save(state, tmp_path / "sync" / "shard.pt")
        monkeypatch.setattr(snapmod, "_device_of", lambda storage: cuda0 if storage._cdata in originals else storage.device)
        snap = snapmod.snapshot(state)
        monkeypatch.undo()
        snap.save(str(tmp_path / "async" / "shard.pt"))
    finally:
        torch.serialization._package_registry[:] = [p for p in torch.serialization._package_registry if p[1] is not as_if_on_gpu]
    sync_pickle = zipfile.ZipFile(tmp_path / "sync" / "shard.pt").read("shard/data.pkl")
    assert sync_pickle.count(b"cuda:0") == 4  # once a tensor, though three of them share one storage
    assert _digest(tmp_path / "async" / "shard.pt") == _digest(tmp_path / "sync" / "shard.pt")


def test_the_size_probe_learns_the_buffers_the_next_snapshot_wants_and_writes_nothing(tmp_path, monkeypatch):
    # a run's first save would copy into pageable memory (pinning runs at ~1.2 GB/s): after the first step the trainer
    # saves through SizeProbe, which writes nothing, and pins buffers of exactly the sizes the save's snapshots want
    from swiftslurm.train.save import snapshot as snapmod

    monkeypatch.setattr(snapmod, "_device_of", lambda storage: torch.device("cuda", 0))  # the "GPU" storages
    flat = torch.randn(64)
    files = {"model_states.pt": {"module": {"w": flat[:32].view(4, 8), "b": flat[32:]}, "step": 3},
             "optim_states.pt": {"fp32": [torch.randn(100)], "state": {0: {"exp_avg": torch.zeros(100),
                                                                           "exp_avg_sq": torch.zeros(100)}}}}
    probe = snapmod.SizeProbe(object())
    for name, state in files.items():
        probe.save(state, str(tmp_path / name))
    assert not list(tmp_path.iterdir())
    wanted = [n for state in files.values() for n in snapshot(state).wanted]
    assert sorted(probe.sizes) == sorted(wanted) == sorted([64 * 4, 100 * 4, 100 * 4, 100 * 4])


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
