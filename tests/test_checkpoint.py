"""Verified checkpoints: two-phase commit, manifests, verify naming each kind of damage, resume choice, retention.

Real files in tmp dirs; the CLI is run as a subprocess (`python -m swiftslurm verify`) for exit codes.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from swiftslurm import checkpoint as ck


def write_hf_like(stage: Path, step: int, world_size: int = 2, shard_bytes: int = 20_000) -> None:
    """Files shaped like an HF Trainer + DeepSpeed ZeRO-2 checkpoint (content differs per step)."""
    g = stage / f"global_step{step}"
    g.mkdir(parents=True, exist_ok=True)
    seed = step.to_bytes(4, "little")
    (g / "mp_rank_00_model_states.pt").write_bytes(hashlib.sha256(seed).digest() * (shard_bytes // 32))
    for r in range(world_size):
        (g / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(os.urandom(shard_bytes))
        (stage / f"rng_state_{r}.pth").write_bytes(os.urandom(300))
    (stage / "latest").write_text(f"global_step{step}")
    (stage / "scheduler.pt").write_bytes(os.urandom(500))
    (stage / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (stage / "adapter_model.safetensors").write_bytes(os.urandom(4000))


def make_checkpoint(out: Path, step: int, algo: str = "xxh3") -> Path:
    stage = ck.prepare_staging(out, step)
    write_hf_like(stage, step)
    ck.commit(stage, ck.final_dir(out, step), algo=algo, meta={"world_size": 2, "seed": 42, "data_position": step * 4})
    return ck.final_dir(out, step)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swiftslurm", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "200"})


# ---------------------------------------------------------------- commit and manifest


@pytest.mark.parametrize("algo,direct", [
    ("xxh3", lambda b: xxhash.xxh3_128(b).hexdigest()),
    ("md5", lambda b: hashlib.md5(b).hexdigest()),
    ("sha256", lambda b: hashlib.sha256(b).hexdigest()),
])
def test_commit_writes_manifest_of_every_file(tmp_path, algo, direct):
    final = make_checkpoint(tmp_path, 7, algo)
    assert not ck.staging_dir(tmp_path, 7).exists()
    assert (tmp_path / "latest").read_text().strip() == "checkpoint-7"
    m = ck.read_manifest(final)
    on_disk = sorted(p.relative_to(final).as_posix() for p in final.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert sorted(m.files) == on_disk and len(on_disk) == 9
    for rel, entry in m.files.items():
        data = (final / rel).read_bytes()
        assert entry == {"size": len(data), "checksum": direct(data)}
    assert m.step == 7 and m.meta["world_size"] == 2 and m.meta["seed"] == 42 and m.meta["data_position"] == 28
    assert "torch" in m.meta["versions"] and "deepspeed" in m.meta["versions"]
    assert m.algo == ck.algo_name(algo)
    assert ck.verify(final).ok


def test_hash_files_parallel_matches_serial_and_progress_counts_every_byte(tmp_path):
    for i in range(12):
        (tmp_path / f"f{i}").write_bytes(os.urandom(1000 * i + 1))
    serial = ck.hash_files(tmp_path, None, "xxh3", workers=1)
    parallel = ck.hash_files(tmp_path, None, "xxh3", workers=4)
    assert serial == parallel and len(serial) == 12
    seen = []
    final = make_checkpoint(tmp_path / "out", 1)
    ck.verify(final, progress=lambda done, total: seen.append((done, total)))
    assert seen[-1][0] == seen[-1][1] == ck.read_manifest(final).total_bytes


def test_commit_uses_rank_hashes_and_hashes_the_rest(tmp_path):
    stage = ck.prepare_staging(tmp_path, 3)
    write_hf_like(stage, 3)
    shard = "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    rank_hashes = ck.hash_files(stage, [shard], "xxh3")  # what rank 1 computed for its own shard
    m = ck.commit(stage, ck.final_dir(tmp_path, 3), algo="xxh3", meta={}, hashes=rank_hashes)
    assert m.files[shard] == rank_hashes[shard] and len(m.files) == 9
    assert ck.verify(ck.final_dir(tmp_path, 3)).ok


def test_each_rank_hashes_the_files_it_wrote_and_rank_0_merges(tmp_path):
    stage = ck.prepare_staging(tmp_path, 5)
    write_hf_like(stage, 5, world_size=3)
    parts = {rank: ck.hash_own_files(stage, rank, "xxh3") for rank in (1, 2)}
    assert sorted(parts[1]) == ["global_step5/zero_pp_rank_1_mp_rank_00_optim_states.pt", "rng_state_1.pth"]
    assert sorted(parts[2]) == ["global_step5/zero_pp_rank_2_mp_rank_00_optim_states.pt", "rng_state_2.pth"]
    reference = ck.hash_files(stage, None, "xxh3")
    m = ck.commit(stage, ck.final_dir(tmp_path, 5), algo="xxh3", meta={}, hashes={**parts[1], **parts[2]})
    assert m.files == reference and ck.verify(ck.final_dir(tmp_path, 5)).ok


def test_prepare_staging_drops_leftovers_of_a_killed_save(tmp_path):
    stage = ck.staging_dir(tmp_path, 5)
    (stage / "global_step5").mkdir(parents=True)
    (stage / "global_step5" / "stale_rank_3.pt").write_bytes(b"old world size")
    assert ck.prepare_staging(tmp_path, 5) == stage and list(stage.iterdir()) == []


def test_commit_replaces_a_damaged_copy_of_the_same_step(tmp_path):
    final = make_checkpoint(tmp_path, 4)
    (final / "scheduler.pt").write_bytes(b"garbage")
    assert not ck.verify(final).ok
    make_checkpoint(tmp_path, 4)
    assert ck.verify(final).ok and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_latest_never_moves_backwards(tmp_path):
    make_checkpoint(tmp_path, 10)
    make_checkpoint(tmp_path, 5)
    assert (tmp_path / "latest").read_text().strip() == "checkpoint-10"


# ---------------------------------------------------------------- damage: verify names it, resume falls back


def flip_byte(ck_dir: Path) -> str:
    rel = "global_step3/mp_rank_00_model_states.pt"
    p = ck_dir / rel
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))
    return rel


def truncate(ck_dir: Path) -> str:
    rel = "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with open(ck_dir / rel, "r+b") as f:
        f.truncate(1000)
    return rel


def delete_shard(ck_dir: Path) -> str:
    rel = "global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt"
    (ck_dir / rel).unlink()
    return rel


def edit_manifest(ck_dir: Path) -> str:
    """Someone 'fixes' a size in the manifest by hand (the JSON stays valid)."""
    p = ck_dir / "manifest.json"
    data = json.loads(p.read_text())
    data["files"]["scheduler.pt"]["size"] += 1
    p.write_text(json.dumps(data))
    return "manifest.json"


def edit_manifest_step(ck_dir: Path) -> str:
    p = ck_dir / "manifest.json"
    p.write_text(p.read_text().replace('"step": 3', '"step": 2'))
    return "manifest.json"


def extra_file(ck_dir: Path) -> str:
    rel = "global_step3/zero_pp_rank_2_mp_rank_00_optim_states.pt"
    (ck_dir / rel).write_bytes(b"a shard from another world size")
    return rel


def no_manifest(ck_dir: Path) -> str:
    (ck_dir / "manifest.json").unlink()
    return "manifest.json"


DAMAGE = {
    "flipped byte": (flip_byte, "checksum mismatch"),
    "truncated file": (truncate, "size 1000 bytes"),
    "deleted shard": (delete_shard, "missing"),
    "edited manifest": (edit_manifest, "edited or corrupted"),
    "edited manifest step": (edit_manifest_step, "edited or corrupted"),
    "extra file": (extra_file, "extra file"),
    "no manifest": (no_manifest, "no manifest.json"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damage_is_named_and_resume_falls_back(tmp_path, kind):
    damage, words = DAMAGE[kind]
    for step in (1, 2, 3):
        make_checkpoint(tmp_path, step)
    newest = ck.final_dir(tmp_path, 3)
    rel = damage(newest)

    result = ck.verify(newest)
    assert not result.ok
    assert any(p.startswith(f"{rel}:") and words in p for p in result.problems), result.problems
    assert ck.verify(ck.final_dir(tmp_path, 2)).ok

    logged: list[str] = []
    assert ck.newest_verified(tmp_path, log=logged.append) == ck.final_dir(tmp_path, 2)
    assert len(logged) == 1 and "checkpoint-3" in logged[0] and rel in logged[0]

    cli = run_cli("verify", str(tmp_path))
    assert cli.returncode == 5, cli.stdout + cli.stderr
    assert rel in cli.stdout and "DAMAGED" in cli.stdout and "resumes from checkpoint-2" in cli.stdout
    assert "Traceback" not in cli.stderr and "newest checkpoint is damaged" in cli.stderr


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_structural_check_finds_all_but_content_changes(tmp_path, kind):
    """verify(contents=False), what `status` shows: everything but a same-size content change, without hashing."""
    damage, _ = DAMAGE[kind]
    newest = make_checkpoint(tmp_path, 3)
    assert ck.verify(newest, contents=False).ok
    damage(newest)
    quick = ck.verify(newest, contents=False)
    assert quick.ok is (kind == "flipped byte"), quick.problems
    assert not ck.verify(newest).ok


def test_renamed_checkpoint_dir_is_caught(tmp_path):
    make_checkpoint(tmp_path, 2)
    os.rename(ck.final_dir(tmp_path, 2), ck.final_dir(tmp_path, 9))
    result = ck.verify(ck.final_dir(tmp_path, 9))
    assert not result.ok and "says step 2" in result.problems[0]


def test_cli_ok_single_checkpoint_array_dirs_and_missing_path(tmp_path):
    for task in ("0", "1"):
        for step in (1, 2):
            make_checkpoint(tmp_path / task, step)
    ok = run_cli("verify", str(tmp_path))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.count("verified") == 4 and "0/checkpoint-2" in ok.stdout
    flip_byte_step = ck.final_dir(tmp_path / "1", 1) / "scheduler.pt"
    flip_byte_step.write_bytes(b"x")
    older_damaged = run_cli("verify", str(tmp_path))  # only the newest decides the exit code
    assert older_damaged.returncode == 0 and "DAMAGED" in older_damaged.stdout
    one = run_cli("verify", str(ck.final_dir(tmp_path / "1", 1)))
    assert one.returncode == 5 and "scheduler.pt" in one.stdout
    missing = run_cli("verify", str(tmp_path / "nope"))
    assert missing.returncode == 1 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr


# ---------------------------------------------------------------- discovery and retention


def test_list_checkpoints_is_numeric_and_ignores_staging(tmp_path):
    for step in (9, 10, 100):
        make_checkpoint(tmp_path, step)
    ck.prepare_staging(tmp_path, 200)
    (tmp_path / "checkpoint-notanumber").mkdir()
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["checkpoint-100", "checkpoint-10", "checkpoint-9"]
    assert ck.list_checkpoints(tmp_path / "absent") == []
    assert ck.newest_verified(tmp_path / "absent") is None


def test_prune_keeps_newest_verified_and_removes_stale(tmp_path):
    for step in range(1, 6):
        make_checkpoint(tmp_path, step)
    ck.prepare_staging(tmp_path, 2)  # leftover of a killed save, older than the newest commit
    ck.prepare_staging(tmp_path, 9)  # a save that may be in progress
    removed = ck.prune(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == [".staging-checkpoint-2", "checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["checkpoint-5", "checkpoint-4"]
    assert ck.staging_dir(tmp_path, 9).exists()


def test_prune_never_counts_a_damaged_checkpoint_as_kept(tmp_path):
    for step in range(1, 5):
        make_checkpoint(tmp_path, step)
    flip = ck.final_dir(tmp_path, 4) / "scheduler.pt"
    flip.write_bytes(b"\0" * 500)  # the newest is damaged after it was committed (and cached as verified)
    delete_shard_dir = ck.final_dir(tmp_path, 2)
    (delete_shard_dir / "trainer_state.json").unlink()  # an older one is damaged too
    ck.prune(tmp_path, keep=2)
    # 4 damaged but newer than every verified one: left for inspection; 3 and 1 are the two kept verified;
    # 2 is damaged and older than the newest verified: removed.
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-3", "checkpoint-1"]
    assert ck.newest_verified(tmp_path, log=None) == ck.final_dir(tmp_path, 3)


def test_prune_with_keep_one_never_deletes_the_only_verified(tmp_path):
    make_checkpoint(tmp_path, 1)
    assert ck.prune(tmp_path, keep=0) == []
    assert ck.newest_verified(tmp_path, log=None) == ck.final_dir(tmp_path, 1)


def test_large_files_hash_in_chunks_and_damage_is_still_found(tmp_path):
    from swiftslurm.checkpoint.manifest import CHUNK_BYTES

    stage = ck.prepare_staging(tmp_path, 1)
    big = os.urandom(3 * CHUNK_BYTES + 123)  # several chunks, not a multiple of one
    (stage / "big.pt").write_bytes(big)
    (stage / "empty.pt").write_bytes(b"")
    m = ck.commit(stage, ck.final_dir(tmp_path, 1), algo="xxh3", meta={})
    assert m.files["big.pt"] == {"size": len(big), "checksum": xxhash.xxh3_128(big).hexdigest()}
    assert m.files["empty.pt"] == {"size": 0, "checksum": xxhash.xxh3_128(b"").hexdigest()}
    seen = []
    assert ck.verify(ck.final_dir(tmp_path, 1), progress=lambda d, t: seen.append((d, t))).ok
    assert seen[-1] == (len(big), len(big)) and len(seen) >= 2
    with open(ck.final_dir(tmp_path, 1) / "big.pt", "r+b") as f:
        f.seek(len(big) - 5)
        f.write(bytes([big[-5] ^ 0x80]))
    assert ck.verify(ck.final_dir(tmp_path, 1)).problems == ["big.pt: xxh3_128 checksum mismatch (content changed)"]


# ---------------------------------------------------------------- unreadable files are damage, not a crash
# Faults that are real for root (the tests run as root, so chmod 000 would not stop a read): a dangling
# symlink, a FIFO (whose open() blocks forever), a directory in a file's place, and a real EIO from the
# kernel: /proc/self/mem read at offset 0 (an unmapped address) fails with EIO. It stats as 0 bytes, so it
# stands in for a file the manifest lists as empty, and the read() error path is what a failing disk takes.


def dangling_symlink(ck_dir: Path) -> str:
    rel = "global_step3/mp_rank_00_model_states.pt"
    (ck_dir / rel).unlink()
    (ck_dir / rel).symlink_to("/nonexistent/scratch/mp_rank_00_model_states.pt")
    return rel


def fifo(ck_dir: Path) -> str:
    rel = "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    (ck_dir / rel).unlink()
    os.mkfifo(ck_dir / rel)
    return rel


def directory(ck_dir: Path) -> str:
    rel = "scheduler.pt"
    (ck_dir / rel).unlink()
    (ck_dir / rel).mkdir()
    return rel


def eio(ck_dir: Path) -> str:
    rel = "added_tokens.json"  # committed empty (see make_checkpoint_with_empty_file)
    (ck_dir / rel).unlink()
    (ck_dir / rel).symlink_to("/proc/self/mem")
    return rel


def fifo_manifest(ck_dir: Path) -> str:
    (ck_dir / "manifest.json").unlink()
    os.mkfifo(ck_dir / "manifest.json")
    return "manifest.json"


UNREADABLE = {
    "dangling symlink": (dangling_symlink, "dangling symlink to /nonexistent/scratch/mp_rank_00_model_states.pt"),
    "fifo": (fifo, "a FIFO, not a regular file"),
    "directory": (directory, "a directory where the manifest lists a file"),
    "eio": (eio, "Input/output error (EIO)"),
    "fifo manifest": (fifo_manifest, "a FIFO, not a regular file"),
}


@pytest.mark.parametrize("kind", list(UNREADABLE))
def test_unreadable_file_is_damage_named_with_its_error_and_resume_falls_back(tmp_path, kind):
    damage, words = UNREADABLE[kind]
    for step in (1, 2, 3):
        stage = ck.prepare_staging(tmp_path, step)
        write_hf_like(stage, step)
        (stage / "added_tokens.json").write_bytes(b"")
        ck.commit(stage, ck.final_dir(tmp_path, step), algo="xxh3", meta={})
    rel = damage(ck.final_dir(tmp_path, 3))

    cli = run_cli("verify", str(tmp_path))  # a subprocess with a timeout: a FIFO must not hang it
    assert cli.returncode == 5, cli.stdout + cli.stderr
    flat = " ".join(cli.stdout.split())
    assert "Traceback" not in cli.stderr and "resumes from checkpoint-2" in flat, cli.stdout + cli.stderr
    assert rel.split("/")[-1] in flat and words.split()[0] in flat, cli.stdout

    result = ck.verify(ck.final_dir(tmp_path, 3))
    assert not result.ok and any(p.startswith(f"{rel}:") and words in p for p in result.problems), result.problems
    logged: list[str] = []
    assert ck.newest_verified(tmp_path, log=logged.append) == ck.final_dir(tmp_path, 2)
    assert len(logged) == 1 and rel in logged[0] and words in logged[0], logged
    ck.prune(tmp_path, keep=2)  # retention does not crash on it either; a newer damaged one stays for inspection
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["checkpoint-3", "checkpoint-2", "checkpoint-1"]


SHRINK_WHILE_HASHING = """
import os, sys
from pathlib import Path
from swiftslurm import checkpoint as ck
out = Path(sys.argv[1])
stage = ck.prepare_staging(out, 1)
(stage / "big.pt").write_bytes(os.urandom(64 << 20))
ck.commit(stage, ck.final_dir(out, 1), algo="xxh3", meta={})
big = ck.final_dir(out, 1) / "big.pt"
def shrink(done, total):
    if done < total // 2 and big.stat().st_size == total:
        os.truncate(big, 1 << 20)  # the file shrinks under the hash, as a page that cannot be read does
result = ck.verify(ck.final_dir(out, 1), progress=shrink, workers=1)
print("PROBLEMS", result.problems)
"""


def test_a_file_that_shrinks_under_the_hash_is_damage_not_sigbus(tmp_path):
    """Hashing through mmap turned this (and an EIO on a mapped page) into SIGBUS, killing the process."""
    proc = subprocess.run([sys.executable, "-c", SHRINK_WHILE_HASHING, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "big.pt: read" in proc.stdout and "changed while verifying" in proc.stdout, proc.stdout


def test_cli_shows_a_progress_bar_for_large_checkpoints(tmp_path, monkeypatch):
    import io

    from rich.console import Console

    from swiftslurm.cli import verify_cmd

    make_checkpoint(tmp_path, 1)
    monkeypatch.setattr(verify_cmd, "PROGRESS_MIN_BYTES", 1000)  # the test checkpoint counts as large
    buf = io.StringIO()
    assert verify_cmd.verify_command(Console(file=buf, force_terminal=True, width=160), tmp_path) == 0
    assert "verifying checkpoint-1" in buf.getvalue() and "verified" in buf.getvalue()


# ---------------------------------------------------------------- does a walltime save fit the grace period


@pytest.mark.parametrize("save_s,step_s,grace,fits,suggested", [
    (50.0, 10.0, 120, True, 80),
    (110.0, 10.0, 120, True, 150),   # exactly grace - step: fits
    (110.5, 10.0, 120, False, 160),
    (600.0, 30.0, 120, False, 790),  # a 1 TB save: ten minutes
    (5.0, 0.0, 1, False, 10),
])
def test_grace_advice_names_the_value_to_set(save_s, step_s, grace, fits, suggested):
    from swiftslurm.checkpoint import savetime

    advice = savetime.grace_advice(save_s, step_s, grace)
    assert (advice is None) == fits
    assert savetime.suggested_grace_s(save_s, step_s) == suggested
    assert savetime.grace_advice(save_s, step_s, suggested) is None  # the suggestion is enough
    if not fits:
        assert f"slurm.signal_grace_s = {grace} s" in advice and advice.endswith(f"HINT: set slurm.signal_grace_s = {suggested}")


def test_commit_reports_its_phases_and_the_save_record_round_trips(tmp_path):
    from swiftslurm.checkpoint import savetime

    stage = ck.prepare_staging(tmp_path, 1)
    write_hf_like(stage, 1)
    timings: dict[str, float] = {}
    ck.commit(stage, ck.final_dir(tmp_path, 1), algo="xxh3", meta={}, timings=timings)
    assert sorted(timings) == ["commit", "fsync", "hash"] and all(v >= 0 for v in timings.values())
    assert savetime.read_save(tmp_path) is None
    record = savetime.record_save(tmp_path, 1, 130.0, {"write": 100.0, **timings, "prune": 0.1}, 12.0, 120)
    assert savetime.read_save(tmp_path) == record
    assert record["save_s"] == 130.0 and record["write_s"] == 100.0 and not record["fits_grace"]
    assert record["advice"].endswith("HINT: set slurm.signal_grace_s = 180")
    (tmp_path / savetime.SAVE_FILE).write_text("{not json")
    assert savetime.read_save(tmp_path) is None


def test_prune_after_a_restart_does_not_rehash_checkpoints_this_job_verified(tmp_path):
    """A requeued job is a new process: the first prune must not re-hash the `keep` checkpoints earlier runs
    committed (at 1 TB each, tens of minutes inside the save barrier). The fingerprints are kept in the
    output dir; a checkpoint whose files changed is hashed again."""
    from swiftslurm.checkpoint import cache

    for step in (1, 2, 3):  # as the trainer does: commit, then prune
        make_checkpoint(tmp_path, step)
        ck.prune(tmp_path, keep=3)
    # a byte changes in checkpoint-2 behind our back, size, inode and mtime kept: only hashing could tell
    shard = ck.final_dir(tmp_path, 2) / "scheduler.pt"
    st = shard.stat()
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    with open(shard, "r+b") as f:
        f.write(data)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    cache._fingerprints.clear()  # the requeued job's new process
    make_checkpoint(tmp_path, 4)
    removed = ck.prune(tmp_path, keep=3)
    assert [p.name for p in removed] == ["checkpoint-1"]  # beyond keep; checkpoint-2 was trusted, not re-hashed
    assert [p.name for p in ck.list_checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-3", "checkpoint-2"]
    assert "checkpoint-1" not in json.loads((tmp_path / cache.CACHE_FILE).read_text())
    assert not ck.verify(ck.final_dir(tmp_path, 2)).ok  # resume never trusts the cache: it hashes
