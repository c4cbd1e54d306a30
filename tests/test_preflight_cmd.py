"""`swiftslurm preflight SPEC`: the diagnostic job end to end (CLI -> submit -> runtime -> gate -> report)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SPEC = """
[job]
name = "preflight-cmd"
output_dir = "{out}"
[slurm]
nodes = {nodes}
tasks_per_node = {tasks}
time = "00:05:00"
signal_grace_s = 30
{partition}
[preflight]
checks = ["ports", "allreduce", "iperf3", "nvme", "disk", "sharedfs"]
min_iperf3_gbps = {iperf}
min_nvme_iops = 100
nvme_path = "{out}"
timeout_s = 45
"""


def run_cli(tmp_path: Path, executor: str, nodes=1, tasks=2, iperf=0.1, partition=""):
    out = tmp_path / "out"
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(out=out, nodes=nodes, tasks=tasks, iperf=iperf, partition=partition))
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items()
           if k == "SWIFTSLURM_LEDGER" or not k.startswith(("SLURM_", "SUBMITIT_", "MASTER_", "SWIFTSLURM_"))}  # the test's own ledger
    proc = subprocess.run([sys.executable, "-m", "swiftslurm", "preflight", str(spec), "--executor", executor, "--json", str(report)],
                          capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    return proc, (json.loads(report.read_text()) if report.exists() else None), out


def test_local_executor_passes(tmp_path):
    proc, doc, out = run_cli(tmp_path, "local")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert doc["ok"] and doc["executor"] == "local" and len(doc["tasks"]) == 1
    report = doc["tasks"][0]
    assert report["world_size"] == 2 and report["mode"] == "preflight"
    assert (out / "preflight" / "report.json").is_file() and (out / "preflight" / "busbw.png").is_file()
    assert re.search(r"preflight total wall time \d+\.\d s", proc.stdout)
    assert "preflight passed" in proc.stdout


def test_local_executor_failure_exits_4(tmp_path):
    proc, doc, _ = run_cli(tmp_path, "local", iperf=100_000)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert doc["ok"] is False
    bad = [r for r in doc["tasks"][0]["results"] if not r["ok"]]
    assert [r["check"] for r in bad] == ["iperf3"] and bad[0]["node"] == "localhost->localhost"
    assert "FAIL" in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.slurm
def test_slurm_four_nodes(tmp_path):
    proc, doc, out = run_cli(tmp_path, "slurm", nodes=4, tasks=1, partition='partition = "debug"')
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = doc["tasks"][0]
    assert report["ok"] and len(report["nodes"]) == 4 and report["executor"] == "slurm"
    assert len([r for r in report["results"] if r["check"] == "ports" and "->" in r["node"]]) == 12  # every ordered pair
    master = [r for r in report["results"] if r["check"] == "ports" and "->" not in r["node"]]
    assert len(master) == 1 and master[0]["ok"] and "MASTER_PORT" in master[0]["observed"]  # free on the master node
    iperf = [r for r in report["results"] if r["check"] == "iperf3"]
    assert len(iperf) == 4 and all(r["data"]["gbps"] > 0.1 for r in iperf)  # the ring
    assert re.search(r"preflight wall time \d+\.\d s", proc.stdout) or "preflight total wall time" in proc.stdout
    assert (out / "preflight" / "busbw.png").is_file()
    assert report["wall_s"] < 60
