"""The preflight across ranks: one process per rank, as srun starts them, on node1..node4's loopback
addresses (127.0.0.1-4 in /etc/hosts). These runs need no Slurm: each process gets the SLURM_*
variables one srun task would see. The same entry under real srun is in test_preflight_slurm.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from swiftslurm.slurm.distenv import PORT_SLOTS
from tests.test_preflight import path_without

NODES = ["node1", "node2", "node3", "node4"]
SPEC = """
[job]
name = "preflight-test"
output_dir = "{out}"
[slurm]
nodes = {n}
[train]
command = ["true"]
[preflight]
checks = ["ports", "allreduce", "iperf3", "nvme", "disk", "sharedfs", "gpu"]
min_iperf3_gbps = {iperf}
min_nvme_iops = {iops}
nvme_path = "{out}"
timeout_s = {preflight_timeout}
{extra}
"""


# the ranks bind node1..node4 -> 127.0.0.1-4, which tests/cluster/up.sh adds to /etc/hosts with the cluster
pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("node_addresses")]


def launch(tmp_path: Path, nodes=NODES, iperf=0.1, iops=100, extra="", env_by_rank=None, job_id=None, timeout_s=120,
           preflight_timeout=30, program=("-m", "swiftslurm.preflight"), args=()):
    """Every rank runs ``python <program> SPEC OUT --mode train <args>``; (exit codes, report, outputs, wall)."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(out=out, n=len(nodes), iperf=iperf, iops=iops, extra=extra, preflight_timeout=preflight_timeout))
    # a job id above Slurm's MaxJobId (an exclude+requeue can never touch a real job), one per test: the ports
    # come from the job id (an inherited MASTER_PORT is ignored), so tests and runs side by side do not share them
    job_id = job_id or str(99_000_000 + zlib.crc32(str(tmp_path).encode()) % PORT_SLOTS)
    procs = []
    t0 = time.monotonic()
    for r, node in enumerate(nodes):
        env = dict(os.environ, SLURM_JOB_ID=job_id, SLURM_PROCID=str(r), SLURM_NTASKS=str(len(nodes)),
                   SLURM_JOB_NODELIST=",".join(nodes), SLURMD_NODENAME=node, SLURM_NODEID=str(r), SLURM_LOCALID="0", SLURM_STEP_ID="0",
                   SLURM_TASKS_PER_NODE=f"1(x{len(nodes)})", **((env_by_rank or {}).get(r, {})))
        procs.append(subprocess.Popen([sys.executable, *program, str(spec), str(out), "--mode", "train", *args],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    codes, logs = [], []
    for p in procs:
        stdout, _ = p.communicate(timeout=timeout_s)
        codes.append(p.returncode)
        logs.append(stdout)
    wall = time.monotonic() - t0
    report = json.loads((out / "preflight" / "report.json").read_text())
    return codes, report, logs, wall


def failures(report):
    return {(r["check"], r["node"]): r for r in report["results"] if not r["ok"]}


@pytest.mark.slow
def test_four_nodes_all_pass(tmp_path):
    codes, report, logs, wall = launch(tmp_path)
    assert codes == [0, 0, 0, 0], logs[0]
    assert report["ok"] and report["decision"]["action"] == "continue"
    checks = {r["check"] for r in report["results"]}
    assert checks == {"ports", "allreduce", "iperf3", "nvme", "disk", "sharedfs", "gpu", "topology"}
    topo = [r for r in report["results"] if r["check"] == "topology"]
    assert sorted(r["node"] for r in topo) == NODES and all(r["ok"] and "ib_ports" in r["data"] for r in topo), topo
    assert len([r for r in report["results"] if r["check"] == "ports" and "->" in r["node"]]) == 12  # every ordered pair
    master = [r for r in report["results"] if r["check"] == "ports" and "->" not in r["node"]]
    assert len(master) == 1 and master[0]["ok"] and "MASTER_PORT" in master[0]["observed"]  # free on the master node
    assert len(report["busbw"]["sizes"]) >= 4 and report["busbw"]["world_size"] == 4
    assert (tmp_path / "out" / "preflight" / "busbw.png").stat().st_size > 1000
    assert "all checks passed" in logs[0] and "preflight wall time" in logs[0]
    assert wall < 120  # loaded CI; the under-a-minute figure is test_preflight_cmd.py::test_slurm_four_nodes


@pytest.mark.slow
def test_faults_named_by_node_with_hints(tmp_path):
    """Unreachable test port on node2, iperf3 and IOPS thresholds above loopback/disk, fio missing on node4."""
    no_fio = path_without(tmp_path, "fio")
    codes, report, logs, _ = launch(
        tmp_path, iperf=100_000, iops=10**9,
        env_by_rank={r: {"SWIFTSLURM_PREFLIGHT_FAULT": "no-listener@node2"} for r in range(4)}
        | {3: {"SWIFTSLURM_PREFLIGHT_FAULT": "no-listener@node2", "PATH": no_fio}},
    )
    assert codes == [4, 4, 4, 4]
    bad = failures(report)
    for src in ("node1", "node3", "node4"):
        r = bad[("ports", f"{src}->node2")]
        assert "node2" in r["observed"] and "node2" in r["hint"]
    assert ("ports", "node2->node1") not in bad
    for pair in ("node1->node2", "node2->node3", "node3->node4", "node4->node1"):
        r = bad[("iperf3", pair)]
        assert "Gbit/s" in r["observed"] and r["hint"]
    for node in ("node1", "node2", "node3"):
        assert "IOPS" in bad[("nvme", node)]["observed"] and bad[("nvme", node)]["hint"]
    fio = bad[("nvme", "node4")]
    assert "'fio' not found" in fio["observed"] and "apt-get install fio" in fio["hint"]
    assert report["decision"]["action"] == "abort"
    assert "FAIL" in logs[0]
