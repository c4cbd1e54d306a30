"""Files we did not write are data, never code: every reader goes through ``fsutil``'s one reading edge.

Each case plants a hostile file where a command reads (a run's task dir, submitit's folder, a checkpoint,
the ledger, a dataset) and runs the real command in a subprocess: it must not run the file's code (a
payload's marker file never appears), hang (a FIFO: it returns within seconds), read a huge or endless file
whole (a sparse 2 GiB file or ``/dev/zero`` under an address-space cap), or end in a traceback (deep JSON,
wrong shapes, NaN/Infinity, huge integers). Each asserts the exit code, the one-line message and that the
directory it read is unchanged (nothing written, nothing deleted).
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swiftslurm import fsutil
from swiftslurm.fsutil import Unreadable

ROOT = Path(__file__).resolve().parents[1]
JOB = "4000001"  # a local job id no process has: the run is over
RETURN_S = 45.0  # a command that blocks on a FIFO never returns; one that reads it right returns in seconds
DEEP = "[" * 100_000 + "]" * 100_000  # RecursionError in json.loads without the depth guard
AS_CAP = 3 << 30  # address space for a command given a 2 GiB file: reading it whole would not fit


class Payload:
    """A pickle that runs ``touch <marker>`` when loaded by plain pickle (or torch.load(weights_only=False))."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# ---------------------------------------------------------------- a finished local run, and how it is looked at


def make_run(root: Path, *, ok_result: bool = True) -> Path:
    """A task dir as a finished local job leaves it: submission record, submitit folder, rank log, metrics."""
    run = root / "run"
    (run / "sub").mkdir(parents=True)
    (run / "logs").mkdir()
    record = {"executor": "local", "job_ids": [JOB], "output_dir": str(run), "task_dirs": [str(run)],
              "folder": str(run / "sub"), "submitted_at": time.time() - 60, "ranks_per_task": 1}
    (run / "submission.json").write_text(json.dumps({"submissions": [record]}))
    if ok_result:
        (run / "sub" / f"{JOB}_0_result.pkl").write_bytes(pickle.dumps(("success", 0)))
    (run / "sub" / f"{JOB}_0_log.out").write_text(log_line("rank 0/1 (local 0/1, node 0/1 node1)"))
    now = time.time()
    (run / "metrics.jsonl").write_text(f'{{"step": 1, "loss": 5.0, "time": {now - 32}}}\n{{"step": 2, "loss": 4.0, "time": {now - 31}}}\n')
    return run


def log_line(text: str) -> str:
    """A runtime log line stamped 30 s ago (doctor reads only lines written since the submission)."""
    return time.strftime("%Y-%m-%d %H:%M:%S,000", time.localtime(time.time() - 30)) + f" [rank 0 node1] {text}\n"


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` (links not followed): kind, size and mtime, to prove nothing was written or deleted."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(dirpath, name))
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            out[rel] = (st.st_mode, st.st_size if not os.path.isdir(os.path.join(dirpath, name)) else 0, st.st_mtime_ns)
    return out


def cli(*args: str, as_cap: int | None = None, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    def limit() -> None:
        if as_cap:
            resource.setrlimit(resource.RLIMIT_AS, (as_cap, as_cap))

    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "swiftslurm", *args], capture_output=True, text=True, timeout=RETURN_S + 60,
                          cwd=ROOT, preexec_fn=limit, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200", **(env or {})})
    return proc, time.monotonic() - t0


def looked_at(command: str, run: Path, *, code: int = 0, as_cap: int | None = None, **kw) -> str:
    """Run ``command`` on ``run``: it returns in time, with ``code``, no traceback, and leaves ``run`` as it was."""
    before = snapshot(run)
    proc, took = cli(command, str(run), as_cap=as_cap, **kw)
    text = proc.stdout + proc.stderr
    assert took < RETURN_S, f"{command} took {took:.0f} s"
    assert "Traceback" not in text and "MemoryError" not in text, text[-3000:]
    assert proc.returncode == code, text[-3000:]
    assert snapshot(run) == before, f"{command} changed {run}"
    return text


# ---------------------------------------------------------------- code in pickles


@pytest.mark.parametrize("command", ["status", "doctor", "logs"])
def test_a_payload_result_pickle_never_runs(tmp_path, command):
    run = make_run(tmp_path, ok_result=False)
    marker = tmp_path / "PWNED"
    (run / "sub" / f"{JOB}_0_result.pkl").write_bytes(pickle.dumps(("success", Payload(marker))))
    text = looked_at(command, run)
    assert not marker.exists()
    if command == "status":
        assert "FAILED" in text  # a result that is not plain values is not a success


def test_a_payload_flight_recorder_dump_never_runs(tmp_path):
    run = make_run(tmp_path)
    marker = tmp_path / "PWNED"
    (run / "logs" / "nccl_trace_rank_0").write_bytes(pickle.dumps({"entries": Payload(marker)}))
    looked_at("doctor", run)
    assert not marker.exists()


def test_a_payload_in_foreign_deepspeed_states_never_runs(tmp_path):
    torch = pytest.importorskip("torch")
    src = tmp_path / "checkpoint-7"
    (src / "global_step7").mkdir(parents=True)
    (src / "trainer_state.json").write_text('{"global_step": 7}')
    (src / "config.json").write_text('{"torch_dtype": "float32"}')
    marker = tmp_path / "PWNED"
    torch.save({"module": {"w": torch.zeros(2)}, "ds_config": {"zero_optimization": {"stage": 2}}, "x": Payload(marker)},
               src / "global_step7" / "mp_rank_00_model_states.pt")
    torch.save({"s": torch.zeros(2)}, src / "global_step7" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (src / "latest").write_text("global_step7")
    from swiftslurm.checkpoint.formats.foreign import inspect_dir

    facts = inspect_dir(src)
    assert not marker.exists()
    assert facts.zero_stage is None and facts.deepspeed  # read with weights_only=True: refused, the stage left unknown
    proc, _ = cli("import", str(src), "--into", str(tmp_path / "into"))
    assert not marker.exists() and "Traceback" not in proc.stdout + proc.stderr


def test_plain_unpickle_refuses_every_class():
    with pytest.raises(Unreadable, match="not allowed"):
        fsutil.plain_unpickle(pickle.dumps(Payload(Path("/nonexistent/x"))))
    assert fsutil.plain_unpickle(pickle.dumps(("success", {"a": [1, 2.5, None, True]}))) == ("success", {"a": [1, 2.5, None, True]})


# ---------------------------------------------------------------- FIFOs: never block


@pytest.mark.parametrize("command,name", [
    ("status", "metrics.jsonl"), ("doctor", "metrics.jsonl"), ("logs", "logs/rank-1.log"), ("doctor", "logs/rank-1.log"),
    ("status", f"sub/{JOB}_0_result.pkl"), ("doctor", "requeues.json"), ("status", "checkpoint-save.json"),
    ("doctor", "logs/nccl_trace_rank_0"), ("status", "restarts.json"), ("doctor", "restarts.json"), ("status", "chain.json"),
    ("doctor", "chain.json"),
])
def test_a_fifo_in_a_files_place_never_hangs(tmp_path, command, name):
    run = make_run(tmp_path)
    path = run / name
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    looked_at(command, run)


def test_a_fifo_submission_record_is_one_message(tmp_path):
    run = make_run(tmp_path)
    (run / "submission.json").unlink()
    os.mkfifo(run / "submission.json")
    text = looked_at("status", run, code=1)
    assert "submission record is unreadable" in text and "a FIFO, not a regular file" in text


@pytest.mark.parametrize("command", ["status", "cancel"])
@pytest.mark.parametrize("plant", ["owner fifo", "owner to /dev/zero", "owner deep", "owner bogus id", "plan fifo, no owner",
                                   "plan names a dir outside"])
def test_a_hand_run_dirs_records_are_data(tmp_path, command, plant):
    """A dir without a submission record (a hand-submitted script): status and cancel read the owner record and the
    plan as data. None of these plants names a job: one message (exit 1), no hang, nothing written or signalled."""
    run = tmp_path / "run"
    run.mkdir()
    owner, plan = run / ".swiftslurm-owner.json", run / "swiftslurm-plan.json"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / ".swiftslurm-owner.json").write_text(json.dumps({"job_id": "1"}))
    if plant == "owner fifo":
        os.mkfifo(owner)
    elif plant == "owner to /dev/zero":
        owner.symlink_to("/dev/zero")
    elif plant == "owner deep":
        owner.write_text('{"job_id": ' + DEEP + "}")
    elif plant == "owner bogus id":
        owner.write_text(json.dumps({"job_id": "1; scancel -u root"}))
    elif plant == "plan fifo, no owner":
        os.mkfifo(plan)
    else:
        plan.write_text(json.dumps({"tasks": [{"output_dir": str(outside)}, {"output_dir": str(run / ".." / "outside")}]}))
    text = looked_at(command, run, code=1)
    assert "no job has run in this dir yet" in text


def test_a_fifo_ledger_is_one_message(tmp_path):
    ledger = tmp_path / "ledger.json"
    os.mkfifo(ledger)
    proc, took = cli("nodes", env={"SWIFTSLURM_LEDGER": str(ledger)})
    text = proc.stdout + proc.stderr
    assert took < RETURN_S and proc.returncode == 1 and "Traceback" not in text
    assert "a FIFO, not a regular file" in text


@pytest.mark.parametrize("command", ["validate", "plan", "render"])
def test_a_fifo_or_a_device_as_the_spec_is_one_message(tmp_path, command):
    os.mkfifo(tmp_path / "job.toml")
    os.symlink("/dev/zero", tmp_path / "zero.toml")
    for spec, kind in (("job.toml", "a FIFO"), ("zero.toml", "a character device")):
        proc, took = cli(command, str(tmp_path / spec))
        text = proc.stdout + proc.stderr
        assert took < RETURN_S and proc.returncode == 2 and "Traceback" not in text, text
        assert f"{kind}, not a regular file" in text


def test_fifos_in_a_foreign_checkpoint_are_problems_not_hangs(tmp_path):
    src = foreign_checkpoint(tmp_path)
    (src / "latest").unlink()
    os.mkfifo(src / "latest")
    os.mkfifo(src / "scheduler.pt")
    before = snapshot(tmp_path)
    proc, took = cli("import", str(src), "--into", str(tmp_path / "into"))
    text = proc.stdout + proc.stderr
    assert took < RETURN_S and proc.returncode == 5 and "Traceback" not in text, text
    assert "latest" in text and "FIFO" in text
    assert snapshot(tmp_path) == before  # a damaged source: nothing committed under --into


# ---------------------------------------------------------------- huge and endless files: never read whole


@pytest.mark.parametrize("command,name", [("status", "metrics.jsonl"), ("doctor", "metrics.jsonl"), ("status", "submission.json"),
                                          ("doctor", "logs/nccl_trace_rank_0.json"), ("logs", "logs/rank-1.log")])
def test_a_sparse_2gib_file_is_not_read_whole(tmp_path, command, name):
    run = make_run(tmp_path)
    with open(run / name, "wb") as fh:
        fh.truncate(2 << 30)  # sparse: no disk used, 2 GiB to a reader
    text = looked_at(command, run, code=1 if name == "submission.json" else 0, as_cap=AS_CAP)
    if name == "submission.json":
        assert "over the 4 MiB cap" in text


@pytest.mark.parametrize("command,name", [("status", "metrics.jsonl"), ("doctor", "logs/nccl_trace_rank_0.json"),
                                          ("logs", "logs/rank-1.log"), ("doctor", "train-summary.json"), ("status", "restarts.json"),
                                          ("doctor", "restarts.json"), ("status", "chain.json")])
def test_a_link_to_dev_zero_is_refused(tmp_path, command, name):
    run = make_run(tmp_path)
    (run / name).unlink(missing_ok=True)
    os.symlink("/dev/zero", run / name)
    looked_at(command, run, as_cap=AS_CAP)


def test_a_huge_sparse_manifest_is_damaged_not_read(tmp_path):
    ckpt = tmp_path / "out" / "checkpoint-1"
    ckpt.mkdir(parents=True)
    with open(ckpt / "manifest.json", "wb") as fh:
        fh.truncate(2 << 30)
    before = snapshot(tmp_path)
    proc, took = cli("verify", str(ckpt), as_cap=AS_CAP)
    text = proc.stdout + proc.stderr
    assert took < RETURN_S and proc.returncode == 5 and "Traceback" not in text and "MemoryError" not in text, text
    assert "over the 256 MiB cap" in text
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------- deep JSON, wrong shapes, numbers out of range


@pytest.mark.parametrize("command,name,text,code,message", [
    ("status", "submission.json", DEEP, 1, "JSON nested deeper than 64 levels"),
    ("status", "submission.json", "[]", 1, "a JSON array where a JSON object belongs"),
    ("status", "submission.json", '{"submissions": [{"executor": "local", "job_ids": "4000001", "output_dir": ".", "task_dirs": [], "folder": ""}]}',
     1, "'job_ids' is a str"),
    ("status", "submission.json", '{"submissions": [{"executor": "local"}]}', 1, "without 'job_ids'"),
    ("status", "submission.json", '{"submissions": {"a": 1}}', 1, "'submissions' is not a list"),
    ("status", "metrics.jsonl", '{"step": 1, "loss": 5.0}\n' + DEEP + '\n{"step": 2, "loss": 1' + "0" * 401 + '}\n', 0, "step 1"),
    ("doctor", "metrics.jsonl", DEEP + "\n", 0, ""),
    ("doctor", "requeues.json", DEEP, 0, ""),
    ("doctor", "train-summary.json", DEEP, 0, ""),
    ("status", "requeues.json", '[{"job_id": "4000001", "restart_count": "many", "outcome": "requeued"}]', 0, ""),
    ("status", "checkpoint-save.json", '{"total_s": Infinity}', 0, ""),
    ("doctor", "preflight/report.json", '{"checks": ' + DEEP + "}", 0, ""),
    ("doctor", "logs/nccl_trace_rank_0.json", DEEP, 0, ""),
    # the in-job restart's and the singleton chain's records (issue #35), written by the job, read by status/doctor
    ("status", "restarts.json", DEEP, 0, ""),
    ("doctor", "restarts.json", '[7, {"job_id": 5, "restarted": "yes"}, {"job_id": "4000001", "restarted": true, "resume_step": "x", '
     '"cause": {"a": 1}, "detail": [1], "next_nodes": "node1", "dropped": null, "time": 1e999}]', 0, ""),
    ("status", "restarts.json", '[{"job_id": "4000001", "restarted": true, "resume_step": 1' + "0" * 401 + ', "detail": "' + "x" * 100_000 + '"}]', 0, ""),
    ("status", "chain.json", '{"chains": [{"links": [1, null]}, {"links": "4000001"}, 7]}', 0, ""),
    ("doctor", "chain.json", '{"chains": "x"}', 0, ""),
    ("status", "chain.json", "[" + DEEP + "]", 0, ""),
])
def test_damaged_records_are_one_message(tmp_path, command, name, text, code, message):
    run = make_run(tmp_path)
    (run / name).parent.mkdir(parents=True, exist_ok=True)
    (run / name).write_text(text)
    out = looked_at(command, run, code=code)
    assert message in out
    if code:
        assert str(run / name) in out  # the message names the file


def test_a_log_claiming_four_billion_ranks_is_not_believed(tmp_path):
    run = make_run(tmp_path)
    (run / "sub" / f"{JOB}_0_log.out").write_text(log_line("rank 1/4000000000 (local 0/1, node 0/1 node1)"))
    looked_at("doctor", run, as_cap=AS_CAP)


@pytest.mark.parametrize("entry,found", [
    ('[{"node": "node1", "reason": "hang", "when": Infinity}]', "Infinity is not a number"),
    (DEEP, "nested deeper than 64"),
    ('{"node": "node1"}', "not a JSON list"),
])
def test_a_damaged_ledger_is_one_message(tmp_path, entry, found):
    ledger = tmp_path / "ledger.json"
    ledger.write_text(entry)
    proc, _ = cli("nodes", env={"SWIFTSLURM_LEDGER": str(ledger)})
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in text, text
    assert "node-health ledger" in text and found in text
    assert ledger.read_text() == entry


# ---------------------------------------------------------------- checkpoints we did not write


def foreign_checkpoint(root: Path) -> Path:
    """An HF Trainer checkpoint with DeepSpeed's shard dir (no tensor files needed for the checks that matter here)."""
    src = root / "src" / "checkpoint-3"
    (src / "global_step3").mkdir(parents=True)
    (src / "trainer_state.json").write_text('{"global_step": 3}')
    (src / "config.json").write_text('{"torch_dtype": "float32"}')
    (src / "latest").write_text("global_step3")
    return src


def safetensors_bytes(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


@pytest.mark.parametrize("name,content,problem", [
    ("manifest.json", '{"files": {"a": {"size": Infinity, "checksum": "x"}}}', "Infinity is not a number"),
    ("manifest.json", DEEP, "nested deeper than 64"),
])
def test_damaged_manifests_are_verify_verdicts(tmp_path, name, content, problem):
    ckpt = tmp_path / "out" / "checkpoint-1"
    ckpt.mkdir(parents=True)
    (ckpt / name).write_text(content)
    before = snapshot(tmp_path)
    proc, _ = cli("verify", str(ckpt))
    text = proc.stdout + proc.stderr
    assert proc.returncode == 5 and "Traceback" not in text, text
    assert problem in text
    assert snapshot(tmp_path) == before


def test_a_manifest_of_the_wrong_shape_is_malformed():
    from swiftslurm.checkpoint.manifest import ManifestError, body_checksum, parse_manifest, writer_fields

    def signed(files, step=1):
        body = {**writer_fields(), "algo": "xxh3_128", "step": step, "meta": {}, "files": files}
        return json.dumps({**body, "body_checksum": body_checksum(body)})

    for files, why in [({"a": {"size": "12", "checksum": "x"}}, "not a size and a checksum"),
                       ({"../../etc/passwd": {"size": 1, "checksum": "x"}}, "leaves the checkpoint"),
                       ({"/etc/passwd": {"size": 1, "checksum": "x"}}, "leaves the checkpoint"),
                       ({"a": [1, 2]}, "not a size and a checksum")]:
        with pytest.raises(ManifestError, match=why):
            parse_manifest(signed(files))
    with pytest.raises(ManifestError, match="files, step or meta"):
        parse_manifest(signed({}, step=True))
    assert parse_manifest(signed({"a/b": {"size": 3, "checksum": "x"}})).files == {"a/b": {"size": 3, "checksum": "x"}}


@pytest.mark.parametrize("plant,problem", [
    (lambda s: (s / "latest").write_text("../../.."), "outside the checkpoint"),
    (lambda s: (s / "latest").write_text("."), "outside the checkpoint"),
    (lambda s: (s / "model.safetensors.index.json").write_text('{"weight_map": {"w": "../../../etc/passwd"}}'), "outside the checkpoint"),
    (lambda s: (s / "model.safetensors.index.json").write_text('{"weight_map": ["w"]}'), "weight_map is not an object"),
    (lambda s: (s / "trainer_state.json").write_text('{"global_step": "3"}'), "not a step number"),
    (lambda s: (s / "trainer_state.json").write_text('{"global_step": 1' + "0" * 401 + "}"), "integer of 402 digits"),
    (lambda s: (s / "trainer_state.json").write_text(DEEP), "nested deeper than 64"),
    (lambda s: (s / "model.safetensors").write_bytes(safetensors_bytes({"w": {"dtype": "F32", "shape": [1], "data_offsets": "0,4"}}, b"\0" * 4)),
     "data_offsets"),
    (lambda s: (s / "model.safetensors").write_bytes(safetensors_bytes({"w": [1, 2]}, b"\0" * 4)), "has no dtype"),
    (lambda s: (s / "model.safetensors").write_bytes(safetensors_bytes({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 1e400]}})),
     "Infinity is not a number"),
])
def test_hostile_foreign_checkpoints_are_refused_with_the_file_named(tmp_path, plant, problem):
    src = foreign_checkpoint(tmp_path)
    plant(src)
    before = snapshot(tmp_path)
    proc, took = cli("import", str(src), "--into", str(tmp_path / "into"))
    text = proc.stdout + proc.stderr
    assert took < RETURN_S and "Traceback" not in text, text
    # a path out of the checkpoint refuses the import (exit 2, tests/test_hostile_ownership.py); the rest is damage (exit 5)
    assert proc.returncode == (2 if "outside" in problem else 5), text
    assert problem in text
    assert snapshot(tmp_path) == before  # refused: nothing committed, nothing changed in the source


# ---------------------------------------------------------------- datasets


@pytest.mark.parametrize("suffix,content", [(".jsonl", '{"text": "a"}\n' + DEEP + "\n"), (".json", "[" + DEEP + "]")])
def test_a_deep_dataset_record_is_a_data_error(tmp_path, suffix, content):
    from swiftslurm.train.data.records import DataError, read_records

    path = tmp_path / f"d{suffix}"
    path.write_text(content)
    with pytest.raises(DataError, match="nested deeper than 64 levels") as exc:
        list(read_records(path))
    assert str(path) in str(exc.value)


@pytest.mark.parametrize("name", ["d.jsonl", "d.json"])
def test_a_fifo_dataset_is_a_data_error(tmp_path, name):
    os.mkfifo(tmp_path / name)
    code = ("import sys; from swiftslurm.train.data.records import DataError, read_records\n"
            "try:\n    list(read_records(sys.argv[1]))\nexcept DataError as exc:\n    print(exc)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / name)], capture_output=True, text=True, timeout=RETURN_S,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # in a subprocess: a reader that blocks fails the test, not the suite
    assert proc.returncode == 0 and "a FIFO, not a regular file" in proc.stdout, proc.stdout + proc.stderr


# ---------------------------------------------------------------- the edge itself


def test_the_edge_refuses_what_is_not_a_bounded_regular_file(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(Unreadable, match="a FIFO, not a regular file"):
        fsutil.read_bytes(tmp_path / "fifo", 10)
    with pytest.raises(Unreadable, match="a character device"):
        fsutil.read_bytes("/dev/zero", 10)
    (tmp_path / "big").write_bytes(b"x" * 11)
    with pytest.raises(Unreadable, match="11 bytes, over the 10 bytes cap"):
        fsutil.read_bytes(tmp_path / "big", 10)
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    with pytest.raises(Unreadable, match="dangling symlink"):
        fsutil.read_bytes(tmp_path / "dangling", 10)
    with pytest.raises(FileNotFoundError):
        fsutil.read_bytes(tmp_path / "absent", 10)


@pytest.mark.parametrize("text,why", [
    (DEEP, "nested deeper than 64"), ("[" * 65 + "]" * 65, "nested deeper than 64"), ('{"a": NaN}', "NaN is not a number"),
    ('{"a": -Infinity}', "-Infinity is not a number"), ('{"a": 1e400}', "out of range"), ('{"a": 1' + "0" * 401 + "}", "402 digits"),
    ('{"a": 9223372036854775808}', "out of range"), ("{", "not valid JSON"), (b"\xff", "not UTF-8"),
])
def test_bounded_json_refuses(text, why):
    with pytest.raises(Unreadable, match=why):
        fsutil.loads_json(text)


def test_json_lines_keep_nan_for_metrics_and_drop_hostile_lines():
    data = b'{"loss": NaN}\n' + DEEP.encode() + b'\n{"loss": 2.0}\n{"lo'
    rows = list(fsutil.json_lines(data, finite=False))
    assert [n for n, _ in rows] == [1, 3] and rows[1][1] == {"loss": 2.0}
    assert [n for n, _ in fsutil.json_lines(data)] == [3]


def test_a_fifo_lock_file_holds_nothing_and_never_blocks(tmp_path):
    os.mkfifo(tmp_path / ".swiftslurm.lock")
    (tmp_path / ".swiftslurm-owner.json").write_text(DEEP)
    code = "import sys; from swiftslurm.node.ownership import holder, _owner; print(holder(sys.argv[1]), _owner(sys.argv[1]))"
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=RETURN_S,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and proc.stdout.split() == ["None", "{}"], proc.stderr


def test_a_flight_dump_with_mixed_keys_and_infinite_numbers_is_not_evidence(tmp_path):
    run = make_run(tmp_path)
    dump = {"pg_status": {0: {"last_enqueued_collective": float("inf")}, "1": {"last_enqueued_collective": 3}}, "entries": 7}
    (run / "logs" / "nccl_trace_rank_0").write_bytes(pickle.dumps(dump))
    looked_at("doctor", run)


def test_a_fifo_planted_at_the_nccl_log_path_never_blocks_the_preflight(tmp_path):
    os.mkfifo(tmp_path / "nccl.log")
    code = "import sys; from pathlib import Path; from swiftslurm.preflight.checks.topology import read_nccl_log; print(read_nccl_log(Path(sys.argv[1])))"
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "nccl.log")], capture_output=True, text=True, timeout=RETURN_S,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stderr


# ------------------------------------------------------------ what we write, at a name something else holds


def plant(tmp_path: Path) -> tuple[Path, bytes]:
    """A file of someone else's that a symlink planted under one of our names would point at."""
    victim = tmp_path / "elsewhere" / "theirs.txt"
    victim.parent.mkdir()
    victim.write_bytes(b"not yours\n")
    return victim, victim.read_bytes()


def test_an_atomic_write_never_writes_through_a_link_at_its_name_nor_at_its_temporary_name(tmp_path):
    victim, before = plant(tmp_path)
    target = tmp_path / "swiftslurm-plan.json"
    tmp_link = tmp_path / f".{target.name}.tmp.{os.getpid()}"  # the predictable temporary name
    tmp_link.symlink_to(victim)
    target.symlink_to(victim)
    fsutil.atomic_write_text(target, "ours\n")
    assert victim.read_bytes() == before
    assert not target.is_symlink() and target.read_text() == "ours\n"  # the link itself was replaced
    assert tmp_link.is_symlink() and os.readlink(tmp_link) == str(victim)  # what was there is left alone
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["elsewhere", target.name, tmp_link.name])


def test_a_named_output_file_is_new_or_the_users_own_regular_file(tmp_path):
    victim, before = plant(tmp_path)
    (tmp_path / "link").symlink_to(victim)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    theirs = tmp_path / "theirs"
    theirs.write_text("another user's\n")
    os.chown(theirs, 65534, 65534)  # CI runs as root
    refused = {}
    for name in ("link", "fifo", "dir", "theirs"):
        with pytest.raises(fsutil.Unwritable) as exc:
            fsutil.write_named_file(tmp_path / name, "x")
        refused[name] = exc.value.why
    assert refused == {"link": f"a symlink (to {victim}), which is never written through", "fifo": "a FIFO, not a regular file",
                       "dir": "a directory, not a regular file", "theirs": "a file of another user (uid 65534)"}
    assert victim.read_bytes() == before and theirs.read_text() == "another user's\n"
    fsutil.write_named_file(tmp_path / "new", "one")
    fsutil.write_named_file(tmp_path / "new", b"two")  # the user's own regular file: replaced
    assert (tmp_path / "new").read_bytes() == b"two"


def test_appends_to_a_log_refuse_a_link_and_a_fifo_without_blocking(tmp_path):
    from swiftslurm.train.health.metrics import MetricsFile

    victim, before = plant(tmp_path)
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(fsutil.NotRegularFile, match="never written through"):
        MetricsFile(tmp_path / "metrics.jsonl").write(1, {"loss": 1.0})
    os.mkfifo(tmp_path / "rank-1.log")
    t0 = time.monotonic()
    with pytest.raises(fsutil.NotRegularFile, match="FIFO"):
        fsutil.open_append_text(tmp_path / "rank-1.log")
    assert time.monotonic() - t0 < 5 and victim.read_bytes() == before
    MetricsFile(tmp_path / "ok" / "metrics.jsonl").write(1, {"loss": 1.0})
    MetricsFile(tmp_path / "ok" / "metrics.jsonl").write(2, {"loss": 0.5})
    assert [json.loads(x)["step"] for x in (tmp_path / "ok" / "metrics.jsonl").read_text().splitlines()] == [1, 2]


@pytest.mark.parametrize("planted", ["symlink", "fifo", "theirs"])
def test_render_and_plot_refuse_to_write_over_what_is_not_the_users_file(tmp_path, monkeypatch, planted):
    from typer.testing import CliRunner

    from swiftslurm.cli import app

    victim, before = plant(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)))
    for name in ("job.sh", "run/metrics.png"):  # render -o FILE, and plot's default PNG beside the metrics
        where = tmp_path / name
        if planted == "symlink":
            where.symlink_to(victim)
        elif planted == "fifo":
            os.mkfifo(where)
        else:
            where.write_text("another user's\n")
            os.chown(where, 65534, 65534)
    for args in (["render", "examples/quickstart.toml", "-o", "job.sh"], ["plot", "run"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and "error: will not write there" in result.output, (args, result.output)
        assert "Traceback" not in result.output
    assert victim.read_bytes() == before
    if planted == "theirs":
        assert all((tmp_path / n).read_text() == "another user's\n" for n in ("job.sh", "run/metrics.png"))
    (tmp_path / "job.sh").unlink()
    assert CliRunner().invoke(app, ["render", "examples/quickstart.toml", "-o", "job.sh"]).exit_code == 0
    assert (tmp_path / "job.sh").read_text().startswith("#!/bin/bash")


def test_no_named_file_is_written_into_a_committed_checkpoint(tmp_path, monkeypatch):
    """plot -o, render -o and preflight --json into a checkpoint (or an export) refuse: it would no longer verify."""
    from typer.testing import CliRunner

    from swiftslurm import checkpoint as ck
    from swiftslurm.cli import app

    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    run_dir = tmp_path / "run"
    staging = ck.prepare_staging(run_dir, 1)
    (staging / "weights.bin").write_bytes(b"w" * 64)
    sealed = ck.final_dir(run_dir, 1)
    ck.commit(staging, sealed, algo="xxh3", meta={})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)))
    for args in (["plot", "run", "-o", "run/checkpoint-1/metrics.png"], ["render", "examples/quickstart.toml", "-o", "run/checkpoint-1/job.sh"],
                 ["preflight", "examples/quickstart.toml", "--json", "run/checkpoint-1/report.json"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and "which its manifest seals" in result.output, (args, result.output)
    assert ck.verify(sealed).ok and sorted(p.name for p in sealed.iterdir()) == ["manifest.json", "weights.bin"]
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "manifest.json").write_text('{"name": "another tool\'s manifest"}')
    assert CliRunner().invoke(app, ["plot", "run", "-o", "elsewhere/metrics.png"]).exit_code == 0


def test_doctor_numbers_the_lines_of_a_long_metrics_file_exactly_or_not_at_all(tmp_path, monkeypatch):
    """Past the kept tail, the lines before it are counted to cite exact line numbers while that head is small enough
    to read quickly; past LINE_COUNT_CAP they are not read (a 2 GiB file took 6-50 s) and rows cite no line (0)."""
    from swiftslurm import fsutil
    from swiftslurm.doctor import evidence

    monkeypatch.setattr(fsutil, "METRICS_CAP", 1000)
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(f'{{"step": {i}, "loss": 1.0}}\n' for i in range(1, 301)))  # 300 lines of 27-29 bytes
    rows = evidence.read_metrics(path)
    assert rows and all(number == row["step"] for number, row in rows) and rows[-1][0] == 300  # exact, past the skipped head
    monkeypatch.setattr(evidence, "LINE_COUNT_CAP", 100)
    rows = evidence.read_metrics(path)
    assert rows[-1][1]["step"] == 300 and {number for number, _ in rows} == {0}
