"""No hangs, no poisoned process group (issue 22 item 7): a stuck tool or check ends bounded with a result naming
its node and check; after a hung all-reduce, training gets a fresh process group.

Stuck tools are fakes on PATH (a `fio` or `nvidia-smi` that ignores SIGTERM and leaves a grandchild holding its
output open): the real ones cannot be put in D state here.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from swiftslurm.preflight import bounded
from swiftslurm.preflight.checks import local
from swiftslurm.slurm.distenv import free_port

STUCK = """#!/bin/sh
trap '' TERM
sleep 1000 &
echo $! > "{pidfile}"
while :; do sleep 1; done
"""


def fake_tool(tmp_path: Path, name: str) -> tuple[str, Path]:
    """A PATH whose ``name`` hangs: ignores SIGTERM (so do its children) and leaves a grandchild on stdout."""
    bin_dir = tmp_path / "stuck-bin"
    bin_dir.mkdir(exist_ok=True)
    pidfile = tmp_path / f"{name}.grandchild"
    (bin_dir / name).write_text(STUCK.format(pidfile=pidfile))
    (bin_dir / name).chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}", pidfile


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def bounded_call(fn, limit_s: float):
    """fn() in a thread; (result, seconds) or a failure when it runs past limit_s (the bug: a hang)."""
    box = {}
    t0 = time.monotonic()
    t = threading.Thread(target=lambda: box.setdefault("r", fn()), daemon=True)
    t.start()
    t.join(limit_s)
    assert not t.is_alive(), f"still running after {limit_s} s: not bounded"
    return box["r"], time.monotonic() - t0


def test_run_kills_the_whole_group_of_a_tool_that_ignores_sigterm(tmp_path):
    path, pidfile = fake_tool(tmp_path, "fio")
    env = dict(os.environ, PATH=path)
    done, took = bounded_call(lambda: bounded.run(["fio"], 1.0, env=env), 20)
    assert done.timed_out and done.returncode is None and not done.unkillable
    assert took < 1 + bounded.TERM_GRACE_S + bounded.KILL_WAIT_S + 2
    assert "fio did not finish within 1 s; killed" == done.describe_timeout("fio", 1)
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while not gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(grandchild), "the tool's grandchild survived"


def test_run_returns_output_and_exit_code():
    done = bounded.run(["sh", "-c", "echo out; echo err >&2; exit 3"], 10)
    assert (done.returncode, done.stdout, done.stderr, done.timed_out) == (3, "out\n", "err\n", False)


def test_stuck_fio_is_a_failed_nvme_result_naming_the_node(tmp_path, monkeypatch):
    path, _ = fake_tool(tmp_path, "fio")
    monkeypatch.setenv("PATH", path)
    results, took = bounded_call(lambda: local.check_nvme("node7", str(tmp_path), 1, timeout_s=1), 20)
    [r] = results
    assert (r.check, r.node, r.ok) == ("nvme", "node7", False)
    assert "fio did not finish within 1 s; killed" in r.observed and r.hint
    assert not list(tmp_path.glob(".swiftslurm-fio-*"))  # its test file is removed all the same


def test_stuck_nvidia_smi_is_a_failed_gpu_result(tmp_path, monkeypatch):
    path, _ = fake_tool(tmp_path, "nvidia-smi")
    monkeypatch.setenv("PATH", path)
    [r], took = bounded_call(lambda: local.check_gpu("node3", 8, timeout_s=1), 20)
    assert (r.check, r.node, r.ok) == ("gpu", "node3", False)
    assert "nvidia-smi did not finish within 1 s" in r.observed and "drain" in r.hint


def test_a_check_stuck_in_python_is_reported_hung_by_check_and_node():
    """What a thread blocked in the kernel (stat on a dead NFS mount) looks like: it never returns."""
    from swiftslurm.preflight.results import CheckResult

    calls = bounded.Calls()
    calls.start("disk", "node2", lambda: threading.Event().wait() or [])
    calls.start("nvme", "node2", lambda: [CheckResult("nvme", "node2", True, "fine")])
    calls.start("gpu", "node2", lambda: 1 / 0)
    results, took = bounded_call(lambda: calls.collect(time.monotonic() + 1.0), 10)
    assert took < 3
    disk, nvme, gpu = results
    assert (disk.check, disk.node, disk.ok) == ("disk", "node2", False) and "did not finish within 1 s (hung)" in disk.observed
    assert "D state" in disk.hint
    assert nvme.ok
    assert not gpu.ok and "ZeroDivisionError" in gpu.observed


# ------------------------------------------------------------------ across ranks (node1..node4 on loopback)

from tests.test_preflight_ranks import failures, launch  # noqa: E402


def needs_nodes(test):
    """The ranks bind node1..node4 -> 127.0.0.1-4, which tests/cluster/up.sh adds to /etc/hosts with the cluster."""
    return pytest.mark.slurm(pytest.mark.usefixtures("node_addresses")(test))


@needs_nodes
def test_stuck_fio_on_one_node_ends_bounded_naming_it(tmp_path):
    path, _ = fake_tool(tmp_path, "fio")
    # the bound is well above what the real fio of the other nodes needs (FIO_RUNTIME_S + laying out its
    # file, several seconds on a busy 2-core machine): only the stuck one may run into it
    bound = 4 * local.FIO_RUNTIME_S + 8
    codes, report, logs, wall = launch(tmp_path, preflight_timeout=bound, env_by_rank={1: {"PATH": path}})
    assert codes == [4, 4, 4, 4], logs[0][-3000:]
    bad = failures(report)
    assert set(bad) == {("nvme", "node2")}, bad
    assert f"fio did not finish within {bound} s" in bad[("nvme", "node2")]["observed"]
    assert report["decision"]["action"] == "abort"
    assert wall < 90


DRIVER = Path(__file__).with_name("preflight_fresh_group.py")


@needs_nodes
def test_training_after_a_hung_allreduce_gets_a_fresh_process_group(tmp_path):
    """on_failure = "warn": every rank goes on after rank 1 hung in the sweep; none may keep the preflight's group
    (rank 1's still had the hung sweep in it), and a new group across all ranks works."""
    codes, report, logs, _ = launch(
        tmp_path, preflight_timeout=5, extra='on_failure = "warn"', program=(str(DRIVER),),
        args=(str(free_port()),), env_by_rank={r: {"SWIFTSLURM_PREFLIGHT_FAULT": "hang-allreduce@rank1"} for r in range(4)},
    )
    assert codes == [0, 0, 0, 0], "\n".join(log[-1500:] for log in logs)
    after = [json.loads(log.strip().splitlines()[-1]) for log in logs]
    assert [a["left"] for a in after] == [False] * 4  # no rank kept the preflight's group
    assert [a["sum"] for a in after] == [4.0] * 4  # the trainer's own group works on every rank
    assert report["decision"]["action"] == "warn"
    assert ("allreduce", "node2") in failures(report)
