"""Nothing of anyone's deleted or signalled, and imports never reach outside the checkpoint (issue 30).

Crafted directories on real files and real processes: foreign checkpoints next to ours under retention, an
import into a dir whose lock a live process holds, forged submission records naming live processes that are
not ours, a parent dir's record, payload pickles, symlinks and paths out of a checkpoint. Each refusal asserts
the exit code, the one message, and that nothing was written or deleted (listings and mtimes before/after).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_checkpoint import make_checkpoint
from test_import import hf_trainer_ckpt

from swiftslurm import checkpoint as ck
from swiftslurm.jobs.record import process_start
from swiftslurm.node import ownership


def snapshot(root: Path) -> list[tuple[str, int, int]] | None:
    """Every entry under ``root`` (links not followed) with its mtime and size; None when ``root`` is absent."""
    if not os.path.lexists(root):
        return None
    out = []
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(dirpath, name)
            st = path.lstat()
            out.append((str(path.relative_to(root)), st.st_mtime_ns, st.st_size))
    return sorted(out)


def swiftslurm(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "swiftslurm", *args], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={**os.environ, "COLUMNS": "400"})


def one_message(proc: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """The command exited ``code`` with one error message holding ``words`` (no traceback); the message, flattened."""
    text = " ".join(proc.stderr.split())
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("error:") == 1, proc.stderr
    for word in words:
        assert word in text, text
    return text


class HeldLock:
    """A real child process holding ``dir``'s lock as rank 0 of job ``job_id`` (ownership.claim), until closed."""

    def __init__(self, out_dir: Path, job_id: str = "4242_0") -> None:
        code = (f"import time; from swiftslurm.node import ownership; ownership.claim({str(out_dir)!r}, 0, {job_id!r}, 'nodeX'); "
                "print('held', flush=True); time.sleep(120)")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "held"

    def __enter__(self) -> "HeldLock":
        return self

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait()


# ---------------------------------------------------------------- retention keeps what is not ours


def hf_run_checkpoint(out: Path, step: int) -> Path:
    """An HF Trainer run's checkpoint-N as the Trainer leaves it in its output_dir: no manifest of ours."""
    ckpt = out / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (ckpt / "model.safetensors").write_bytes(os.urandom(64))
    return ckpt


def test_retention_deletes_only_checkpoints_of_ours_beyond_keep(tmp_path):
    foreign = [hf_run_checkpoint(tmp_path, step) for step in (1, 3, 50)]  # older, between and newer than ours
    unreadable = tmp_path / "checkpoint-2"
    unreadable.mkdir()
    (unreadable / "manifest.json").write_text('{"format": "swiftslurm-checkpoint", ' + "[" * 100_000)  # not ours to judge
    edited = make_checkpoint(tmp_path, 4)
    manifest = json.loads((edited / "manifest.json").read_text())
    manifest["step"] = 5
    (edited / "manifest.json").write_text(json.dumps(manifest))  # its body checksum no longer matches: unreadable
    kept = {p: snapshot(p) for p in [*foreign, unreadable, edited]}
    logged: list[str] = []
    for step in (10, 11, 12, 13):  # our saves, each followed by retention as the trainer does
        make_checkpoint(tmp_path, step)
        ck.prune(tmp_path, keep=2, log=logged.append)
    names = [p.name for p in ck.list_checkpoints(tmp_path)]
    assert names == ["checkpoint-50", "checkpoint-13", "checkpoint-12", "checkpoint-4", "checkpoint-3", "checkpoint-2", "checkpoint-1"]
    assert {p: snapshot(p) for p in kept} == kept  # not a file touched
    assert len(logged) == 5 and all("not a checkpoint of ours" in line for line in logged), logged  # said once each
    assert any("checkpoint-50" in line and "no manifest.json" in line for line in logged), logged
    assert ck.newest_verified(tmp_path, log=None) == ck.final_dir(tmp_path, 13)


def test_an_import_never_removes_a_staging_dir_it_did_not_make(tmp_path):
    """A `.staging-checkpoint-N` in DIR may be a save in progress or another job's: an outside import leaves it."""
    src = hf_trainer_ckpt(tmp_path / "theirs")
    into = tmp_path / "run"
    staging = ck.prepare_staging(into, 4)
    (staging / "rank0.pt").write_bytes(b"partial")
    before = snapshot(into)
    r = swiftslurm("import", str(src), "--into", str(into))
    one_message(r, 2, "a save or import of step 4 is unfinished", ".staging-checkpoint-4", "nothing was imported")
    assert snapshot(into) == before


# ---------------------------------------------------------------- import into a dir a live job holds


def test_import_into_a_dir_another_job_holds_is_refused_and_touches_nothing(tmp_path):
    src = hf_trainer_ckpt(tmp_path / "theirs")
    run = tmp_path / "run"
    make_checkpoint(run, 2)
    staging = ck.prepare_staging(run, 4)  # the live job's save in progress, the step the import would take
    (staging / "rank0.pt").write_bytes(b"half written")
    with HeldLock(run):
        before = snapshot(run)
        r = swiftslurm("import", str(src), "--into", str(run))
        one_message(r, 3, "another job owns this output dir", "job 4242_0", "nothing was written")
        assert snapshot(run) == before  # its staging dir and latest are as they were
        # a dir inside the live job's dir (what train.resume_from imports into) is the job's too
        r = swiftslurm("import", str(src), "--into", str(run / "resume-source"))
        one_message(r, 3, "another job owns this output dir", f"{run}, a dir above")
        assert snapshot(run) == before and not (run / "resume-source").exists()
    assert (run / "latest").read_text().strip() == "checkpoint-2"


def test_an_import_holds_the_dir_so_no_rank_starts_in_it(tmp_path):
    """While `import` writes, DIR is held: a rank of a job claiming it stops, naming the dir's owner."""
    claim = f"from swiftslurm.node import ownership; ownership.SAME_JOB_WAIT_S = 0; ownership.claim({str(tmp_path)!r}, 1, '777')"
    asks = f"from swiftslurm.node import ownership; print(ownership.holder({str(tmp_path)!r}) is not None)"  # another process: sees the lock
    with ownership.outside_writer(tmp_path, "import"):
        probe = subprocess.run([sys.executable, "-c", claim], capture_output=True, text=True, timeout=60)
        assert probe.returncode != 0 and "another job is running in this output dir" in probe.stderr, probe.stderr
        assert subprocess.run([sys.executable, "-c", asks], capture_output=True, text=True, timeout=60).stdout.strip() == "True"
    assert ownership.holder(tmp_path) is None
    assert subprocess.run([sys.executable, "-c", claim], capture_output=True, timeout=60).returncode == 0  # free again


def test_a_step_of_the_same_job_still_holding_the_dir_is_named_as_such(tmp_path):
    """An in-job restart or requeue whose earlier processes did not exit: after the wait, the rank says it is this
    job's own earlier run (stuck), not another job."""
    hold = f"import time; from swiftslurm.node import ownership; ownership.claim({str(tmp_path)!r}, 0, '777'); print('held', flush=True); time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        claim = f"from swiftslurm.node import ownership; ownership.SAME_JOB_WAIT_S = 0.5; ownership.claim({str(tmp_path)!r}, 0, '777')"
        probe = subprocess.run([sys.executable, "-c", claim], capture_output=True, text=True, timeout=60)
    finally:
        holder.kill()
        holder.wait()
    assert probe.returncode != 0 and "an earlier run of this job still holds its output dir" in probe.stderr, probe.stderr
    assert "did not exit within 0.5 s" in probe.stderr and "another job" not in probe.stderr


# ---------------------------------------------------------------- cancel signals only what it started


def forged_record(out: Path, pid: int, **fields) -> Path:
    """A submission.json naming ``pid`` with its real start time copied from /proc (anyone can write this)."""
    out.mkdir(parents=True, exist_ok=True)
    record = {"executor": "local", "job_ids": [str(pid)], "output_dir": str(out), "task_dirs": [str(out)],
              "folder": str(out / "logs" / "submitit" / "x"), "pid_starts": {str(pid): process_start(pid)},
              "cwd": os.readlink(f"/proc/{pid}/cwd"), "submitted_at": time.time(), **fields}
    (out / "submission.json").write_text(json.dumps({"submissions": [record]}))
    return out / "submission.json"


def test_cancel_refuses_a_forged_record_and_the_process_lives(tmp_path):
    sleeper = subprocess.Popen(["sleep", "120"], cwd=tmp_path)
    try:
        out = tmp_path / "out"
        forged_record(out, sleeper.pid)
        before = snapshot(out)
        r = swiftslurm("cancel", str(out))
        one_message(r, 3, "cancel refused: not a process this submission started", f"pid {sleeper.pid} runs `sleep 120`",
                    "nothing was signalled")
        # a record naming another output dir than the one it sits in is not this dir's to stop
        elsewhere = tmp_path / "elsewhere"
        forged_record(elsewhere, sleeper.pid, output_dir=str(out))
        moved = snapshot(elsewhere)
        one_message(swiftslurm("cancel", str(elsewhere)), 3, "the record here names another output dir")
        time.sleep(0.3)
        assert sleeper.poll() is None, "cancel signalled a process it did not start"
        assert snapshot(out) == before and snapshot(elsewhere) == moved  # the records are not even marked cancelled
    finally:
        sleeper.kill()
        sleeper.wait()


START_CONTROLLER = """
import os, sys
from pathlib import Path
os.chdir(sys.argv[2])
from submitit.local.local import start_controller
Path(sys.argv[3]).write_text(str(start_controller(folder=sys.argv[1], command="sleep 120", timeout_min=5).pid))
"""


def _gone(pid: int, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.2)
    return False


def test_cancel_proves_a_real_controller_by_folder_and_working_dir(tmp_path):
    """A real submitit controller (started from /) is stopped only by a record with its folder and its dir."""
    out = tmp_path / "out"
    folder = out / "logs" / "submitit" / "x"
    folder.mkdir(parents=True)
    subprocess.run([sys.executable, "-c", START_CONTROLLER, str(folder), "/", str(tmp_path / "pid")], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=60, check=True)
    pid = int((tmp_path / "pid").read_text())
    try:
        forged_record(out, pid, folder=str(folder), cwd=str(tmp_path))
        one_message(swiftslurm("cancel", str(out)), 3, f"pid {pid} works in /, not in {tmp_path}")
        forged_record(out, pid, folder=str(out / "logs" / "submitit" / "y"), cwd="/")
        one_message(swiftslurm("cancel", str(out)), 3, "not this submission's submitit controller")
        assert not _gone(pid, 0.5)
        forged_record(out, pid, folder=str(folder), cwd="/")  # every fact matches: the controller this record launched
        r = swiftslurm("cancel", str(out))
        assert r.returncode == 0, r.stdout + r.stderr
        assert _gone(pid), "the controller outlived its cancel"
    finally:
        if not _gone(pid, 0):
            os.kill(pid, 15)
            _gone(pid)


# ---------------------------------------------------------------- a parent's record blocks only with a held lock


SPEC = """
[job]
name = "parent"
output_dir = "parent/out"
[slurm]
nodes = 1
tasks_per_node = 1
time = "00:05:00"
[train]
command = ["true"]
[preflight]
checks = []
"""


class Payload:
    """Unpickling this runs `touch MARKER`: what a hostile pickle does."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_parent_record_blocks_a_submit_only_while_a_lock_is_held_there(tmp_path):
    from swiftslurm.jobs.record import load_submission

    parent = tmp_path / "parent"
    sleeper = subprocess.Popen(["sleep", "120"], cwd=tmp_path)
    marker = tmp_path / "PWNED"
    try:
        forged_record(parent, sleeper.pid, task_dirs=[str(parent / "out")])  # "a live job" writing where we will
        folder = Path(json.loads((parent / "submission.json").read_text())["submissions"][0]["folder"])
        folder.mkdir(parents=True)
        import pickle

        (folder / f"{sleeper.pid}_0_result.pkl").write_bytes(pickle.dumps(Payload(marker)))
        (tmp_path / "s.toml").write_text(SPEC)
        with HeldLock(parent, "5151"):
            before = snapshot(parent)
            r = swiftslurm("submit", "s.toml", "--executor", "local", cwd=tmp_path)
            one_message(r, 3, "an active job already owns this output dir", f"{parent}, a dir above", "job 5151")
            assert snapshot(parent) == before  # not even the new output dir was made
        r = swiftslurm("submit", "s.toml", "--executor", "local", cwd=tmp_path)  # the record alone: no lock, no block
        assert r.returncode == 0, r.stdout + r.stderr
        assert load_submission(str(parent / "out")).wait(timeout_s=120, poll_s=0.5) == {"0": "COMPLETED"}
        assert not marker.exists(), "a pickle named by a parent's record was unpickled"
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()


# ---------------------------------------------------------------- imports stay inside the checkpoint


def test_a_payload_pickle_in_deepspeed_state_never_runs(tmp_path):
    src = hf_trainer_ckpt(tmp_path / "theirs")
    marker = tmp_path / "PWNED"
    states = src / "global_step4" / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.zeros(4)}, "ds_config": {"zero_optimization": {"stage": 2}}, "hook": Payload(marker)}, states)
    r = swiftslurm("import", str(src), "--into", str(tmp_path / "ours"), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not marker.exists(), "the import ran code from the checkpoint's DeepSpeed state"
    facts = json.loads(r.stdout)
    assert facts["zero_stage"] is None and facts["deepspeed"] is True  # the state could not be read safely: unknown
    assert any("ZeRO stage 1 or 2" in note for note in facts["notes"])


def _outside_cases(src: Path, outside: Path) -> dict:
    outside.mkdir(exist_ok=True)
    (outside / "secret.txt").write_text("not theirs to import")
    return {
        "file link out": (lambda: os.symlink(outside / "secret.txt", src / "notes.txt"), "notes.txt: a symlink to"),
        "dangling link": (lambda: os.symlink(tmp_gone(src), src / "gone.bin"), "gone.bin: a symlink to"),
        "shard dir link out": (lambda: _move_out(src / "global_step4", outside / "global_step4"), "global_step4: a symlink to"),
        "shard dir second name": (lambda: os.symlink("global_step4", src / "global_step5"), "a directory reached twice"),
        "loop": (lambda: os.symlink("..", src / "global_step4" / "up"), "a directory reached twice"),
        "latest out": (lambda: (src / "latest").write_text("../../.."), "latest: names '../../..'"),
        "weight_map out": (lambda: (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../../etc/passwd"}})),
                           "weight_map names '../../etc/passwd'"),
    }


def tmp_gone(src: Path) -> str:
    return str(src.parent / "was-here")


def _move_out(shard_dir: Path, to: Path) -> None:
    shard_dir.rename(to)
    os.symlink(to, shard_dir)


@pytest.mark.parametrize("case", ["file link out", "dangling link", "shard dir link out", "shard dir second name", "loop", "latest out",
                                  "weight_map out"])
def test_a_path_out_of_the_checkpoint_refuses_the_import(tmp_path, case):
    src = hf_trainer_ckpt(tmp_path / "theirs")
    make, named = _outside_cases(src, tmp_path / "outside")[case]
    make()
    before = snapshot(tmp_path / "theirs")
    r = swiftslurm("import", str(src), "--into", str(tmp_path / "ours"))
    one_message(r, 2, "the checkpoint to import points outside itself", named, "nothing was imported")
    assert not (tmp_path / "ours").exists()
    assert snapshot(tmp_path / "theirs") == before


def test_a_link_inside_the_checkpoint_is_copied_as_a_file(tmp_path):
    """A symlink that stays inside is followed: the committed copy holds its content, never a link."""
    src = hf_trainer_ckpt(tmp_path / "theirs")
    os.symlink("config.json", src / "generation_config.json")
    r = swiftslurm("import", str(src), "--into", str(tmp_path / "ours"))
    assert r.returncode == 0, r.stdout + r.stderr
    final = tmp_path / "ours" / "checkpoint-4"
    copied = final / "generation_config.json"
    assert not copied.is_symlink() and copied.read_text() == (src / "config.json").read_text()
    assert not any(p.is_symlink() for p in final.rglob("*"))
    assert any(rel.startswith("global_step4/") for rel in ck.read_manifest(final).files)  # its shards came along
    assert swiftslurm("verify", str(final)).returncode == 0


@pytest.mark.parametrize("header,why", [
    ({"w": {"dtype": "F32", "shape": "four", "data_offsets": [0, 16]}}, "tensor 'w' in its safetensors header has no shape"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}}, "tensor 'w' in its safetensors header has no data_offsets"),
    ({"w": [1, 2, 3]}, "tensor 'w' in its safetensors header has no dtype"),
    (["not", "an", "object"], "its safetensors header is not a JSON object"),
    ("deep", "its safetensors header is JSON nested deeper than"),
    ("huge", "a safetensors header length of"),
])
def test_a_safetensors_header_of_the_wrong_shape_is_damage(tmp_path, header, why):
    src = hf_trainer_ckpt(tmp_path / "theirs")
    if header == "huge":
        raw = struct.pack("<Q", 1 << 60) + b"{}"
    else:
        text = "[" * 100_000 + "]" * 100_000 if header == "deep" else json.dumps(header)
        raw = struct.pack("<Q", len(text)) + text.encode() + b"\0" * 16
    (src / "model.safetensors").write_bytes(raw)
    r = swiftslurm("import", str(src), "--into", str(tmp_path / "ours"))
    one_message(r, 5, "the checkpoint to import is damaged", f"model.safetensors: damaged: {why}")
    assert not (tmp_path / "ours").exists()


@pytest.mark.parametrize("name", ["latest", "trainer_state.json", "config.json"])
def test_a_fifo_in_a_foreign_checkpoint_is_damage_not_a_hang(tmp_path, name):
    src = hf_trainer_ckpt(tmp_path / "theirs")
    (src / name).unlink()
    os.mkfifo(src / name)
    r = swiftslurm("import", str(src), "--into", str(tmp_path / "ours"))  # the 120 s timeout: a hang fails the test
    one_message(r, 5, "the checkpoint to import is damaged", f"{name}: a FIFO, not a regular file")
    assert not (tmp_path / "ours").exists()
