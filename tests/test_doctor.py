"""`swiftslurm doctor` (issue 14): findings from what real runs left, and from realistically written files.

Real local-executor runs whose ``train.command`` fails the way training fails (rank 1 raising a captured GPU
error text, ranks waiting in a real gloo all-reduce for a rank that sleeps, spins or dies) are read by the
real CLI; the metrics, requeue and preflight rules run on files written as the trainer, the runtime and the
preflight write them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from runs import explain

from swiftslurm import ledger
from swiftslurm.doctor import diagnose_task
from swiftslurm.doctor.evidence import Line, TaskRun, read_task
from swiftslurm.doctor.rules.hang import culprits, stack_dumps
from swiftslurm.doctor.target import runs_of
from swiftslurm.jobs.send import submit_plan
from swiftslurm.plan import make_plan
from swiftslurm.spec import parse_toml, validate_spec

HEALTHY_RUN = Path(__file__).parent / "data" / "watch_run"  # the quickstart model, 12 steps, 2 ranks (local)
WAIT_S = 180

# Captured from GPU runs (torch 2.x on H100s / A100s): the texts the rules must recognise. Marked as captured:
# this machine has no GPU to make them.
CAPTURED_CUDA_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity "
                     "of 79.10 GiB of which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.03 GiB memory "
                     "in use. Of the allocated memory 75.61 GiB is allocated by PyTorch, and 1.71 GiB is reserved by PyTorch "
                     "but unallocated.")
CAPTURED_DEVICE_MISMATCH = ("RuntimeError: Expected all tensors to be on the same device, but found at least two devices, "
                            "cuda:1 and cpu! (when checking argument for argument mat2 in method wrapper_CUDA_mm)")
CAPTURED_MISSING_KEYS = ("RuntimeError: Error(s) in loading state_dict for PeftModelForCausalLM:\n\tMissing key(s) in "
                         "state_dict: \"base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight\".")

# train.command: every rank starts; ``fail``: rank BAD fails with the text in file ARG; ``sleep``/``spin``/``die``: every rank joins a
# gloo all-reduce, then rank BAD sleeps, spins or SIGKILLs itself before the second one, which the others wait in.
WORKER = textwrap.dedent(r"""
    import datetime, os, signal, sys, time
    mode, bad, arg = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rank = int(os.environ["RANK"])
    print(f"worker rank {rank} up", flush=True)
    if mode == "fail":  # the traceback a failing trainer prints, ending with the text captured in file ARG
        if rank == bad:
            text = open(arg).read()
            sys.stderr.write('Traceback (most recent call last):\n  File "train.py", line 12, in <module>\n    step()\n' + text + "\n")
            sys.exit(1)
        sys.exit(0)
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(arg)))
    t = torch.ones(2)
    dist.all_reduce(t)
    print(f"rank {rank} joined the first all-reduce", flush=True)
    if rank == bad:
        if mode == "sleep":
            time.sleep(4 * float(arg))
        elif mode == "spin":
            end = time.time() + 4 * float(arg)
            while time.time() < end:
                pass
        else:
            os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(t)
""")


def run_local(tmp_path: Path, args: list[str], ranks: int, spec_extra: str = "", nodes: int = 1, executor: str = "local",
              slurm_extra: str = 'time = "00:05:00"', command: list[str] | None = None):
    out = tmp_path / "out"
    text = f"""
[job]
name = "doctor"
output_dir = {json.dumps(str(out))}
[slurm]
nodes = {nodes}
tasks_per_node = {ranks}
{slurm_extra}
[train]
command = {json.dumps(command or [sys.executable, "-c", WORKER, *args])}
per_device_train_batch_size = 4
{spec_extra}
[preflight]
checks = []
"""
    raw = parse_toml(text)
    plan = make_plan(validate_spec(raw), raw, base_dir=str(tmp_path), source="doctor.toml")
    sub = submit_plan(plan, executor=executor)
    sub.wait(timeout_s=WAIT_S, poll_s=0.5)
    return out if executor == "local" else (out, sub)


def node_of(out: Path, rank: int) -> str:
    """The node a rank ran on, as its own log's ``[rank r node]`` tag says."""
    tag = f"[rank {rank} "
    return [ln for ln in (out / "logs" / f"rank-{rank}.log").read_text().splitlines() if tag in ln][0].split(tag)[1].split("]")[0]


def cli(*args):
    return subprocess.run([sys.executable, "-m", "swiftslurm", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})


def doctor_json(target: Path) -> list[dict]:
    proc = cli("doctor", str(target), "--json")
    assert proc.returncode == 6, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


# ---------------------------------------------------------------- a healthy run


def test_a_healthy_quickstart_run_has_nothing_wrong():
    proc = cli("doctor", str(HEALTHY_RUN))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "nothing wrong found" in proc.stdout
    assert json.loads(cli("doctor", str(HEALTHY_RUN), "--json").stdout) == []


# ---------------------------------------------------------------- errors from real runs (captured texts raised)


@pytest.mark.parametrize("code,text,keys", [
    ("cuda_oom", CAPTURED_CUDA_OOM, "train.per_device_train_batch_size"),
    ("device_mismatch", CAPTURED_DEVICE_MISMATCH, "train.deepspeed"),
    ("ckpt_missing_keys", CAPTURED_MISSING_KEYS, "train.resume_weights_only"),
])
def test_a_failing_rank_is_named_with_file_line_and_fix(tmp_path, code, text, keys):
    (tmp_path / "captured.txt").write_text(text)
    out = run_local(tmp_path, ["fail", "1", str(tmp_path / "captured.txt")], ranks=2, spec_extra='deepspeed = "zero3_offload"')
    findings = doctor_json(out)
    mine = [f for f in findings if f["code"] == code]
    assert mine, findings
    f = mine[0]
    assert f["ranks"] == [1] and keys in f["keys"]
    ev = f["evidence"][0]
    assert ev["rank"] == 1 and ev["node"] and ev["file"] == "logs/rank-1.log" and ev["line"] >= 1
    lines = (out / ev["file"]).read_text().splitlines()
    assert lines[ev["line"] - 1].strip() == ev["text"] and ev["text"] in text  # the line the evidence points at
    if code == "device_mismatch":
        assert "optimizer on cpu" in f["cause"]  # offload on, from the task's spec
    assert [x["code"] for x in findings].count(code) == 1
    human = cli("doctor", str(out))
    assert human.returncode == 6 and code in human.stdout and "fix" in human.stdout


# ---------------------------------------------------------------- hangs from real gloo collectives


@pytest.mark.parametrize("mode", ["sleep", "die", "spin"])
def test_hang_names_the_rank_the_others_wait_for(tmp_path, mode):
    out = run_local(tmp_path, [mode, "2", "6"], ranks=4)
    findings = doctor_json(out)
    assert findings[0]["code"] == "hang", findings
    hang = findings[0]
    assert hang["ranks"] == [2] and hang["nodes"] == ["localhost"], hang
    assert "rank 2 (localhost)" in hang["what"] and "never joined" in hang["what"]
    if mode == "die":
        assert any(f["code"] == "node_failure" and f["ranks"] == [2] for f in findings), findings
    assert any(f["code"] == "nccl_timeout" for f in findings)
    assert ledger.read() == []  # a local run's "node" is this machine: never recorded in the node-health ledger


def test_a_rank_that_logs_the_lost_peer_late_waited_with_the_others_the_silent_rank_is_the_culprit(tmp_path):
    """Rank 2's process is gone: ranks 1 and 3 lose it at once, rank 0 (its node loaded) says so 40 s later. Without a
    timeout nobody arrived late: rank 0 waited too, and the culprit is the one rank that said nothing."""
    def lost(rank: int, at: float) -> Line:
        return Line(f"rank-{rank}.log", 1, rank, "localhost", at, "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:4242")

    spec = {"slurm": {"nodes": 1, "tasks_per_node": 4}}
    run = TaskRun(0, str(tmp_path), state="FAILED", lines=[[lost(1, 100.0)], [lost(3, 100.5)], [lost(0, 140.0)]], spec=spec)
    found = culprits(run)
    assert found is not None and (found.ranks, found.waiting) == ((2,), (0, 1, 3)), found
    # with timeouts they waited out, a rank whose error came long after theirs did arrive late: it is named too
    timed_out = Line("rank-1.log", 1, 1, "localhost", 100.0, "Timed out waiting 1000ms for recv operation to complete")
    run = TaskRun(0, str(tmp_path), state="FAILED", lines=[[timed_out], [lost(3, 100.5)], [lost(0, 140.0)]], spec=spec)
    found = culprits(run)
    assert found is not None and found.ranks == (0, 2) and "long after theirs" in found.how, found


@pytest.mark.slurm
def test_hang_on_the_cluster_names_rank_and_node_by_job_id(tmp_path):
    out, sub = run_local(tmp_path, ["sleep", "2", "6"], ranks=2, nodes=2, executor="slurm")
    findings = doctor_json(Path(sub.job_ids[0]))  # by job id: found through the paths Slurm recorded
    hang = findings[0]
    assert hang["code"] == "hang" and hang["ranks"] == [2], findings
    node_of_2 = node_of(out, 2)
    assert hang["nodes"] == [node_of_2] and f"rank 2 ({node_of_2})" in hang["what"]
    entries = ledger.read()  # remembered: the next submit avoids the node (tests/test_ledger.py)
    assert [(e.node, e.reason, e.job) for e in entries] == [(node_of_2, "hang", sub.job_ids[0])], entries
    doctor_json(Path(sub.job_ids[0]))
    assert len(ledger.read()) == 1  # a second look records nothing twice


@pytest.mark.slurm
def test_a_rank_killed_on_the_cluster_is_a_node_failure_and_its_node_is_remembered(tmp_path):
    out, sub = run_local(tmp_path, ["die", "2", "6"], ranks=2, nodes=2, executor="slurm")
    findings = doctor_json(out)
    lost = [f for f in findings if f["code"] == "node_failure"]
    node_of_2 = node_of(out, 2)
    assert lost and lost[0]["ranks"] == [2] and lost[0]["nodes"] == [node_of_2] and "SIGKILL" in lost[0]["what"], findings
    assert ("node_failure", node_of_2) in {(e.reason, e.node) for e in ledger.read()}, ledger.read()


@pytest.mark.slurm
@pytest.mark.slow
def test_a_real_walltime_requeue_loop_is_walltime_loop_and_blames_no_node(tmp_path):
    """A job whose time limit ends it before it ever saves, requeued by the runtime until slurm.max_requeues."""
    out, _ = run_local(tmp_path, [], ranks=1, executor="slurm", command=["sleep", "600"],
                       slurm_extra='time = "00:01:00"\nsignal_grace_s = 20\nmax_requeues = 1')
    findings = doctor_json(out)
    assert [f["code"] for f in findings] == ["walltime_loop"], findings  # Slurm's SIGTERMs are no node's failure
    loop = findings[0]
    assert "2 times in a row" in loop["what"] and "slurm.signal_grace_s" in loop["keys"] and "now 20" in loop["fix"]
    assert ledger.read() == []


# ---------------------------------------------------------------- stack dumps (real faulthandler output)

DUMPER = textwrap.dedent(r"""
    import datetime, faulthandler, os, signal, sys, time
    import torch, torch.distributed as dist
    rank = int(sys.argv[1])
    log = open(sys.argv[2], "a")
    log.write(f"2026-12-01 05:00:00,000 [rank {rank} node{rank + 1}] INFO rank {rank}/2 (local 0/1, node {rank}/2 node{rank + 1})\n")
    log.flush()
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)  # what node/banner.enable_stack_dumps does
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{sys.argv[3]}",
                            timeout=datetime.timedelta(seconds=60))
    open(sys.argv[2] + ".ready", "w").close()
    if rank == 1:
        time.sleep(60)
    dist.all_reduce(torch.ones(2))
""")


def test_stack_dumps_name_the_rank_outside_the_collective(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    port = str(20000 + os.getpid() % 10000)
    procs = [subprocess.Popen([sys.executable, "-c", DUMPER, str(r), str(logs / f"rank-{r}.log"), port]) for r in (0, 1)]
    try:
        deadline = time.time() + 90
        while not all((logs / f"rank-{r}.log.ready").exists() for r in (0, 1)):
            assert time.time() < deadline, "the two ranks did not start"
            time.sleep(0.2)
        time.sleep(1.0)  # rank 0 enters the all-reduce
        for p in procs:
            p.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for r in (0, 1):
        (logs / f"rank-{r}.log.ready").unlink()
    run = read_task(0, str(tmp_path))
    dumps = {d.rank: d for lines in run.lines for d in stack_dumps(lines)}
    assert dumps[0].in_collective and not dumps[1].in_collective
    assert "sleep" in dumps[1].top() or "<module>" in dumps[1].top()
    found = culprits(run)
    assert found.ranks == (1,) and found.waiting == (0,) and "stack" in found.how
    hang = [f for f in diagnose_task(run) if f.code == "hang"][0]
    assert hang.ranks == (1,) and hang.nodes == ("node2",) and hang.evidence[0].file == "logs/rank-1.log"


# ---------------------------------------------------------------- metrics, requeues, preflight (written as the writers write)


def write_metrics(root: Path, rows: list[dict]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))  # json writes NaN as NaN, as the trainer does


def rows(n: int, start: float = 1000.0, **extra) -> list[dict]:
    return [{"step": s, "time": start + s, "loss": 2.0, "grad_norm": 1.0, "step_time_s": 1.0, **extra} for s in range(1, n + 1)]


@pytest.mark.parametrize("bad,found", [(10, True), (9, False)])
def test_nan_grad_norm_after_ten_consecutive_logged_steps(tmp_path, bad, found):
    data = rows(5) + [{**r, "grad_norm": float("nan"), "loss": float("inf") if i % 2 else 3.0} for i, r in enumerate(rows(bad, 1005.0))]
    for i, r in enumerate(data):
        r["step"] = i + 1
    data.insert(8, {"step": 8, "time": 1008.5, "checkpoint": "checkpoint-8"})  # a save row in between: not a training row
    write_metrics(tmp_path, data + [{"step": 99, "time": 2000.0, "loss": 1.0, "grad_norm": 1.0}])
    codes = [f for f in diagnose_task(read_task(0, str(tmp_path))) if f.code == "nan_grad_norm"]
    assert bool(codes) is found
    assert not diverged_of(tmp_path)  # finite rows 3.0 after 2.0: no rise; a NaN run is the NaN rule's
    if found:
        assert codes[0].evidence[0].file == "metrics.jsonl" and codes[0].evidence[0].step == 6 and "train.max_grad_norm" in codes[0].keys
        assert "train.max_grad_norm = 0.5, now 1" in codes[0].fix  # the default, as no spec.json says otherwise


DIVERGED_RUN = Path(__file__).parent / "data" / "doctor" / "diverged_lr10"  # a real lr = 10 quickstart run (its README)


def diverged_of(root: Path) -> list:
    return [f for f in diagnose_task(read_task(0, str(root))) if f.code == "diverged"]


def test_diverged_on_a_real_run_with_learning_rate_10(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    (root / "metrics.jsonl").write_bytes((DIVERGED_RUN / "metrics.jsonl").read_bytes())
    (root / "spec.json").write_text(json.dumps({"spec": {"train": {"learning_rate": 10, "max_grad_norm": 1.0}}}))
    found = diverged_of(root)
    assert len(found) == 1, found
    f = found[0]
    assert "loss rose from 5.626" in f.what and "to step 40" in f.what and "grad norm rose from 2.96" in f.what
    assert [(e.file, e.step) for e in f.evidence] == [("metrics.jsonl", 1), ("metrics.jsonl", 40)] * 2
    assert "train.learning_rate (now 10; try 1)" in f.fix and "train.max_grad_norm = 0.5, now 1" in f.fix
    assert f.keys == ("train.learning_rate", "train.warmup_ratio", "train.max_grad_norm")
    assert all(f.code != "nan_grad_norm" for f in diagnose_task(read_task(0, str(root))))


def curve(losses: list[float], grads: list[float] | None = None) -> list[dict]:
    """Rows as the trainer logs them (logging_first_step: step 1, then every 5), a save row in between."""
    out = [{"step": 1 if i == 0 else 5 * i, "time": 1000.0 + i, "loss": x, "grad_norm": (grads or [1.0] * len(losses))[i],
            "learning_rate": 1e-4} for i, x in enumerate(losses)]
    out.insert(len(out) // 2, {"step": out[len(out) // 2]["step"], "time": 1000.5, "checkpoint": "checkpoint-x"})
    return out


@pytest.mark.parametrize("losses,grads", [
    # the run: ~5 at first, thousands in between, 131 where it stopped (logging every 5 steps, 10 rows)
    ([5.1, 2210.0, 4870.0, 3920.0, 2950.0, 1700.0, 980.0, 402.0, 255.0, 131.0], [3.0, 95.0, 180.0, 240.0, 190.0, 130.0, 88.0, 61.0, 40.0, 22.0]),
    # the grad norm alone explodes (300x), the loss still looks fine
    ([2.1, 2.0, 1.9, 1.9, 1.8, 1.9, 1.8, 1.9], [0.9, 1.1, 1.0, 8.0, 60.0, 240.0, 310.0, 280.0]),
    # four rows are enough (two windows of two)
    ([3.0, 3.1, 40.0, 55.0], None),
])
def test_diverged_without_nan(tmp_path, losses, grads):
    write_metrics(tmp_path, curve(losses, grads))
    found = diverged_of(tmp_path)
    assert len(found) == 1 and found[0].evidence[0].file == "metrics.jsonl"
    assert ("loss rose" in found[0].what) == (losses[-1] > 10) and ("grad norm rose" in found[0].what) == bool(grads and grads[-1] > 100)


def test_a_divergence_that_ends_in_nan_is_one_finding(tmp_path):
    write_metrics(tmp_path, curve([5.0, 5.2, 400.0, 3000.0, 9000.0] + [float("nan")] * 10))
    assert [f.code for f in diagnose_task(read_task(0, str(tmp_path)))] == ["nan_grad_norm"]


def test_a_loss_of_hundreds_of_digits_is_no_traceback(tmp_path):
    data = curve([2.0, 1.9, 1.8, 1.7, 1.6, 1.5])
    data[-1]["loss"] = 10 ** 400  # json writes the int whole; float() of it overflows
    write_metrics(tmp_path, data)
    assert diverged_of(tmp_path) == []  # not finite: neither a rise nor a crash


def healthy_curves() -> list:
    import random

    rnd = random.Random(30)
    return [
        [5.6 * 0.93 ** i for i in range(30)],  # going down
        [2.0 + rnd.uniform(-0.8, 0.8) for _ in range(40)],  # noisy but flat
        [1.2, 1.1, 1.0, 0.9, 0.9, 1.4, 1.8, 1.7, 1.6],  # a bump at the end, under 2x
        [0.05, 0.04, 0.05, 0.2, 0.25, 0.3],  # a loss near 0 growing 6x: only 0.25 higher, noise
        [9.0, 3.0, 120.0],  # too few rows to tell (3)
    ]


@pytest.mark.parametrize("losses", healthy_curves())
def test_no_diverged_on_healthy_curves(tmp_path, losses):
    lora_grads = [0.02 * 1.6 ** i for i in range(len(losses))][:len(losses)]  # LoRA from B = 0: norms grow, stay small
    write_metrics(tmp_path, curve(losses, [min(g, 5.0) for g in lora_grads]))
    assert diverged_of(tmp_path) == []


@pytest.mark.parametrize("fixture", sorted(p.parent.name for p in (Path(__file__).parent / "data").rglob("metrics.jsonl")
                                           if p.parent != DIVERGED_RUN))
def test_no_diverged_on_any_metrics_fixture(tmp_path, fixture):
    src = next(p for p in (Path(__file__).parent / "data").rglob("metrics.jsonl") if p.parent.name == fixture)
    (tmp_path / "metrics.jsonl").write_bytes(src.read_bytes())
    assert len(read_task(0, str(tmp_path)).metrics) >= 6
    assert diverged_of(tmp_path) == []


def test_speed_diagnosis_in_its_steps(tmp_path):
    busy = tmp_path / "busy"
    write_metrics(busy, rows(8, comm_wait_ratio=0.1, data_wait_ratio=0.05, gpu_util=97.0))
    assert diagnose_task(read_task(0, str(busy))) == []
    comm = tmp_path / "comm"
    write_metrics(comm, [{**r, "comm_wait_ratio": 0.9} for r in rows(1)] + rows(8, 1001.0, comm_wait_ratio=0.45, data_wait_ratio=0.02, gpu_util=0.6))
    assert [f.code for f in diagnose_task(read_task(0, str(comm)))] == ["low_gpu_util", "comm_bound"]
    data = tmp_path / "data"
    write_metrics(data, rows(8, comm_wait_ratio=0.05, data_wait_ratio=0.5, gpu_util=40))
    found = diagnose_task(read_task(0, str(data)))
    assert [f.code for f in found] == ["low_gpu_util", "data_bound"] and "data loader" in found[0].cause
    assert "train.dataloader_num_workers" in found[1].keys
    warm = tmp_path / "warm"  # only the warm-up row is slow: not comm-bound
    write_metrics(warm, [{**r, "comm_wait_ratio": 0.9} for r in rows(1)] + rows(6, 1001.0, comm_wait_ratio=0.1))
    assert diagnose_task(read_task(0, str(warm))) == []


def test_walltime_loop_from_the_requeue_records_and_the_save_record(tmp_path):
    from swiftslurm.checkpoint.savetime import record_save

    records = [{"job_id": "77", "restart_count": i, "global_step": step, "requeued": True, "outcome": "requeued", "message": "m"}
               for i, step in enumerate([10, 40, 40, 40])]
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "requeues.json").write_text(json.dumps(records))
    record_save(tmp_path, 40, save_s=200.0, phases_s={"write": 150.0}, step_s=5.0, signal_grace_s=120)
    found = [f for f in diagnose_task(read_task(0, str(tmp_path))) if f.code == "walltime_loop"]
    assert len(found) == 1 and "3 times" in found[0].what and "step 40" in found[0].what
    assert "slurm.signal_grace_s = 260" in found[0].cause and "slurm.signal_grace_s" in found[0].keys
    (tmp_path / "requeues.json").write_text(json.dumps(records[:2]))  # progress between the stops: no loop
    assert not [f for f in diagnose_task(read_task(0, str(tmp_path))) if f.code == "walltime_loop"]


def test_preflight_failures_blame_the_node(tmp_path):
    from swiftslurm.preflight.report import build_report, write_report
    from swiftslurm.preflight.results import CheckResult, decide

    results = [CheckResult("ports", "node1->node3", False, "connection refused", "open", "open the port range"),
               CheckResult("ports", "node2->node3", False, "connection refused", "open", "open the port range"),
               CheckResult("ports", "node1->node2", True, "open")]
    write_report(tmp_path, build_report(results, decide(results, "abort", ["node1", "node2", "node3"]), {}))
    found = [f for f in diagnose_task(read_task(0, str(tmp_path))) if f.code == "node_failure"]
    assert len(found) == 1 and found[0].nodes == ("node3",) and "abort" in found[0].what
    assert found[0].evidence[0].file == "preflight/report.json" and "connection refused" in found[0].evidence[0].text


def test_a_stalled_run_is_a_hang_even_without_a_culprit(tmp_path):
    write_metrics(tmp_path, rows(20))
    run = read_task(0, str(tmp_path), state="TIMEOUT")
    run.end_time = 1020.0 + 600.0
    found = diagnose_task(run)
    assert [f.code for f in found] == ["hang"] and "after step 20" in found[0].what and "USR1" in found[0].fix
    run.end_time = 1020.0 + 5.0  # the usual pace: not stalled
    assert diagnose_task(run) == []
    run.end_time, run.summary = 1020.0 + 600.0, {"global_step": 20}  # it finished
    assert diagnose_task(run) == []


# Captured from a Slurm cluster with cgroup memory enforcement (slurmstepd's words when the OOM killer ends a task);
# marked as captured: the test cluster here does not enforce memory.
CAPTURED_STEPD_OOM = "slurmstepd: error: Detected 1 oom_kill event in StepId=812.0. Some of the step tasks have been OOM Killed."


def test_a_rank_the_oom_killer_ended_is_host_oom_and_its_node_is_not_blamed(tmp_path):
    from swiftslurm.doctor.evidence import Line
    from swiftslurm.doctor.remember import ledger_entries

    killed = Line("812_0_log.err", 3, 1, "node2", 1000.0, "srun: error: node2: task 1: Killed")
    oom = Line("812_0_log.err", 2, 1, "node2", 999.0, CAPTURED_STEPD_OOM)
    run = TaskRun(0, str(tmp_path), state="OUT_OF_MEMORY", job_id="812", lines=[[oom, killed]], executor="slurm")
    found = diagnose_task(run)
    assert [f.code for f in found][:2] == ["node_failure", "host_oom"] and "slurm.mem" in found[1].keys
    assert ledger_entries(found, [run]) == []  # the job's memory, not the node's health
    run = TaskRun(0, str(tmp_path), state="FAILED", job_id="812", lines=[[killed]], executor="slurm")
    assert [(e.node, e.reason, e.job) for e in ledger_entries(diagnose_task(run), [run])] == [("node2", "node_failure", "812")]
    run.executor = "local"
    assert ledger_entries(diagnose_task(run), [run]) == []


# ---------------------------------------------------------------- the progress watchdog (a real training run)

STALLED = """
[job]
name = "stalled"
output_dir = {out}
[slurm]
tasks_per_node = 2
time = "00:10:00"
signal_grace_s = 60
[train]
model = "tiny-llama"
dataset = [{data}]
train_type = "full"
deepspeed = "zero2"
gradient_checkpointing = false
per_device_train_batch_size = 2
max_steps = 8
max_length = 128
save_steps = 100
logging_steps = 1
[checkpoint]
forced_save_fractions = []
[preflight]
checks = []
[env]
SWIFTSLURM_TEST_STALL = "1:5:40"
SWIFTSLURM_WATCHDOG_FLOOR_S = "4"
"""


@pytest.mark.slow
def test_the_watchdog_dumps_every_rank_when_one_stops_stepping_and_doctor_names_it(tmp_path):
    """Rank 1 of a real 2-rank DeepSpeed run sleeps after step 5 (the test hook) while rank 0 waits in the step's
    all-reduce: each rank's watchdog dumps its stacks into its log without anyone sending USR1."""
    out = tmp_path / "out"
    data = Path(__file__).parent.parent / "examples" / "data" / "alpaca_demo.jsonl"
    raw = parse_toml(STALLED.format(out=json.dumps(str(out)), data=json.dumps(str(data))))
    sub = submit_plan(make_plan(validate_spec(raw), raw, base_dir=str(tmp_path), source="stalled.toml"), executor="local")
    states = list(sub.wait(timeout_s=400, poll_s=1).values())
    assert states == ["COMPLETED"], f"{states}\n{explain(out)}"  # the sleep ends, the run finishes
    run = runs_of(str(out))[0]
    dumps = {d.rank: d for lines in run.lines for d in stack_dumps(lines)}
    assert set(dumps) == {0, 1}, sorted(dumps)
    assert dumps[0].in_collective and not dumps[1].in_collective and "step_done" in dumps[1].top()
    # each rank's watchdog also dumped its flight record; rank 0 gathered them and logged who is where
    assert set(run.flight) == {0, 1}, sorted(run.flight)
    said = "\n".join(ln.text for ln in run.all_lines if ln.rank == 0 and "watchdog:" in ln.text)
    assert "rank 0 (localhost): waits in collective #" in said, said
    assert "hang: rank 1 (localhost) never joined collective #" in said, said
    # and py-spy (the train extra installs it) dumped each rank from outside: idle or active, per thread
    spied = {ln.rank for ln in run.all_lines if "py-spy dump of rank" in ln.text}
    assert spied == {0, 1}, spied
    found = culprits(run)
    assert found.ranks == (1,) and found.waiting == (0,)
    assert "flight record stops before collective #" in found.how and found.evidence[0].file == "logs/nccl_trace_rank_1.json"
    hang = [f for f in diagnose_task(run) if f.code == "hang"]
    assert hang and hang[0].ranks == (1,) and hang[0].nodes == ("localhost",)


def _fr_dump(rank: int, enqueued: int, completed: int, node: str = "", pg: str = "0") -> dict:
    """A flight record shaped as torch 2.13's gloo dump (``_dump_fr_trace_json``), trimmed to what is read."""
    entries = [{"collective_seq_id": i, "pg_id": int(pg), "profiling_name": "gloo:all_reduce" if i % 2 else "gloo:broadcast",
                "process_group": [pg, "default_pg"], "state": "scheduled"} for i in range(1, enqueued + 1)]
    dump = {"entries": entries, "pg_status": {pg: {"last_completed_collective": str(completed),
                                                   "last_enqueued_collective": str(enqueued), "last_started_collective": "-1"}}, "version": "2.10"}
    if node:
        dump["swiftslurm"] = {"rank": rank, "node": node, "time": 0}
    return dump


def test_flight_records_name_the_rank_missing_from_the_collective_the_others_wait_in(tmp_path):
    from swiftslurm.train.health import frtrace

    # 4 ranks: 0, 1 and 3 entered collective #7 (an all_reduce) and wait; rank 2 finished #6 and never entered #7
    records = {r: _fr_dump(r, 6 if r == 2 else 7, 6, f"node{r + 1}") for r in range(4)}
    v = frtrace.verdict(records, [0, 1, 2, 3])
    assert (v.collective, v.op, v.waiting, v.behind, v.gone, v.culprits) == (7, "gloo:all_reduce", (0, 1, 3), (2,), (), (2,))
    lines = frtrace.describe(v, frtrace.nodes_of(records))
    assert "rank 2 (node3): last entered collective #6, completed #6: not in #7" in lines
    assert lines[-1] == "hang: rank 2 (node3) never joined collective #7 gloo:all_reduce that ranks 0, 1, 3 wait in"
    # a rank that left no record (dead, or stuck outside Python): gone, and a culprit too
    del records[3]
    v = frtrace.verdict(records, [0, 1, 2, 3])
    assert v.culprits == (2, 3) and v.gone == (3,)
    # everyone waits in the same collective (a slow step, a bad link): nobody is missing, no verdict
    assert frtrace.verdict({r: _fr_dump(r, 7, 6) for r in range(3)}, [0, 1, 2]) is None
    # all finished: nobody waits
    assert frtrace.verdict({r: _fr_dump(r, 7, 7) for r in range(3)}, [0, 1, 2]) is None
    # a rank whose last async op is not marked done yet is still behind by what it entered
    v = frtrace.verdict({0: _fr_dump(0, 9, 8), 1: _fr_dump(1, 8, 7)}, [0, 1])
    assert v.behind == (1,) and v.waiting == (0,)


def test_flight_record_files_are_read_whatever_wrote_them_and_hostile_pickles_are_refused(tmp_path):
    import pickle

    from swiftslurm.train.health import frtrace

    prefix = tmp_path / "logs" / "nccl_trace_rank_"
    prefix.parent.mkdir()
    (tmp_path / "logs" / "nccl_trace_rank_0").write_bytes(pickle.dumps(_fr_dump(0, 7, 6)))  # torch's own, on NCCL timeout
    (tmp_path / "logs" / "nccl_trace_rank_1.json").write_text(json.dumps(_fr_dump(1, 6, 6, "node2")))  # our watchdog's

    class Boom:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (tmp_path / "logs" / "nccl_trace_rank_2").write_bytes(pickle.dumps({"entries": [Boom()]}))
    (tmp_path / "logs" / "nccl_trace_rank_3.json").write_text('{"entries": [')  # torn
    records = frtrace.read_dumps(str(prefix))
    assert sorted(records) == [0, 1] and not (tmp_path / "pwned").exists()
    assert records[1]["_file"].endswith("nccl_trace_rank_1.json")
    assert frtrace.read_dumps(str(prefix), since=time.time() + 60) == {}  # an earlier run's dumps do not count


def test_the_watchdog_limit_follows_the_median_step_and_stays_under_the_timeout():
    from swiftslurm.train.health.watchdog import limit_s

    assert limit_s([1.0, 1.0], 1800) is None  # warming up
    assert limit_s([0.5, 9.0, 1.0, 1.0, 1.2], 1800) == 60.0  # 10 x 1.0 s is under the 60 s floor
    assert limit_s([20.0, 20.0, 30.0], 1800) == 200.0  # a slow step: 10 x the median
    assert limit_s([200.0, 200.0, 200.0], 1800) == 1440.0  # never past 80% of the process-group timeout


# A rank whose other threads run Python while the watchdog fires: faulthandler's timed dump (a C thread without the
# GIL) walked their frames as they changed and crashed the rank with SIGSEGV within a few dumps; ``MODE`` "gil"
# holds the GIL in C code instead (libc's sleep through ctypes.PyDLL), where only faulthandler's C thread can dump.
FIRING = textwrap.dedent(r"""
    import ctypes, sys, threading, time
    from swiftslurm.train.health.watchdog import ProgressWatchdog
    mode, log = sys.argv[1], open(sys.argv[2], "w")
    def deep(n):
        return [str(i) for i in range(20)] if n == 0 else deep(n - 1)
    def busy():
        while True:
            deep(200)  # pushes and pops 200 frames, over and over
    for _ in range(2):
        threading.Thread(target=busy, daemon=True).start()
    watchdog = ProgressWatchdog(0, 1800, target=log, environ={"SWIFTSLURM_WATCHDOG_BACKUP_S": "0.5"})
    if mode == "busy":
        for _ in range(60):
            watchdog._arm(0.002)  # fires 2 ms later, while both threads recurse
            time.sleep(0.05)
    else:
        watchdog._arm(0.2)
        ctypes.PyDLL(None).sleep(3)  # holds the GIL for 3 s: the timer's thread cannot run, the backup dumps
        time.sleep(0.5)  # now the timer's thread runs
    watchdog.stop()
    print("survived", flush=True)
""")


@pytest.mark.parametrize("mode", ["busy", "gil"])
def test_the_watchdog_dumps_without_crashing_a_rank_whose_threads_run_python(tmp_path, mode):
    log = tmp_path / "stacks.log"
    proc = subprocess.run([sys.executable, "-c", FIRING, mode, str(log)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": "/usr/bin:/bin"})  # no py-spy: the stacks alone
    assert proc.returncode == 0 and "survived" in proc.stdout, (proc.returncode, proc.stderr[-2000:])
    text = log.read_text()
    ours = text.count("watchdog: no step for")
    dumps = stack_dumps([Line("stacks.log", i + 1, 0, "localhost", 0.0, t) for i, t in enumerate(text.splitlines())])
    if mode == "busy":
        assert ours >= 30 and "Timeout (" not in text, (ours, text[:500])  # the timer's thread wrote them, not C
        # each whole: the main thread, both recursing ones (past 100 frames: faulthandler's "..."), the timer's own
        assert len(dumps) == ours, (len(dumps), ours)
        for d in dumps:
            funcs = [{f.func for f in t} for t in d.threads]
            assert d.main[-1].func == "<module>" and sum(bool(f & {"deep", "busy"}) for f in funcs) == 2, funcs
            assert any("_fire" in f for f in funcs), funcs
    else:
        # faulthandler's C thread dumped while the GIL was held (the main thread in <module>), then the timer's thread
        assert text.index("Timeout (0:00:00.700000)!") < text.index("watchdog: no step for"), text[:500]
        assert dumps[0].main and dumps[0].main[0].func == "<module>", dumps[0]


@pytest.mark.parametrize("reason, keys", [
    ("PartitionConfig", ("slurm.time", "slurm.gpus_per_node", "slurm.cpus_per_task", "slurm.mem", "slurm.nodes")),
    ("QOSMaxWallDurationPerJobLimit", ("slurm.time", "slurm.gpus_per_node", "slurm.cpus_per_task", "slurm.mem", "slurm.nodes")),
    ("launch failed requeued held", ("slurm.exclude",)),
    ("JobHeldAdmin", ()),
])
def test_a_held_task_is_explained_by_slurms_reason_code(tmp_path, reason, keys):
    run = TaskRun(0, str(tmp_path), state="HELD", job_id="77", held=f"held ({reason})", hold_reason=reason)
    [finding] = [f for f in diagnose_task(run) if f.code == "held"]
    assert finding.keys == keys, finding


def test_words_of_a_hold_in_the_output_dir_do_not_change_the_explanation(tmp_path):
    """The note names the output dir (`swiftslurm cancel DIR`): a dir called after another kind of hold is still a hold."""
    note = "held by Slurm (JobHeldUser: ...); `swiftslurm cancel '/runs/launch failed/will not start it as submitted'` ends it"
    run = TaskRun(0, str(tmp_path), state="HELD", job_id="77", held=note, hold_reason="JobHeldUser")
    [finding] = [f for f in diagnose_task(run) if f.code == "held"]
    assert finding.keys == () and "a hold" in finding.cause, finding
