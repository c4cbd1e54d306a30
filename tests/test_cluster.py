"""The local Slurm cluster itself (tests/cluster/up.sh): the facts every Slurm test builds on.

node1..nodeN are slurmd daemons on one machine, each on its own loopback address 127.0.0.I.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import wait_for_job

pytestmark = pytest.mark.slurm


def run(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)


def sbatch(args: list[str]) -> str:
    proc = run(["sbatch", "--parsable", *args], 30)
    assert proc.returncode == 0, f"sbatch {args} failed: {proc.stderr}"
    return proc.stdout.strip().split(";")[0]


@contextlib.contextmanager
def cancelled_on_exit(job_id: str):
    """Whatever happens in the test, leave no job of it behind (scancel of a finished job is harmless)."""
    try:
        yield job_id
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)


def test_the_daemons_ports_lie_outside_every_range_a_job_takes_ports_from():
    """The four nodes share this machine's ports: a daemon on a port a job derives (distenv.port_for_job) or a test
    picks (FREE_PORT_RANGE) fails that job as 'busy' once the job ids reach it."""
    import re

    from swiftslurm.slurm import distenv

    text = (Path(__file__).parent / "cluster" / "lib.sh").read_text()
    ports = {k: int(v) for k, v in re.findall(r"(?m)^(SLURMCTLD_PORT|SLURMDBD_PORT|SLURMD_PORT_BASE)=(\d+)", text)}
    assert len(ports) == 3, text
    daemon = [ports["SLURMCTLD_PORT"], ports["SLURMDBD_PORT"], *(ports["SLURMD_PORT_BASE"] + i for i in range(1, 17))]
    assert all(port < distenv.FREE_PORT_RANGE[0] for port in daemon), daemon
    assert distenv.FREE_PORT_RANGE[1] == distenv.PORT_BASE  # the derived range starts where the picked one ends


def test_srun_spans_every_node(slurm_cluster):
    n = len(slurm_cluster)
    assert slurm_cluster == tuple(f"node{i}" for i in range(1, n + 1)) and n >= 2
    proc = run(
        ["srun", f"-N{n}", f"-n{n}", "--time=1", "bash", "-c", 'echo "$SLURM_NODEID $SLURMD_NODENAME $SLURM_JOB_NODELIST"'],
        120,
    )
    assert proc.returncode == 0, proc.stderr
    rows = sorted(tuple(line.split()) for line in proc.stdout.splitlines())
    assert rows == [(str(i), f"node{i + 1}", f"node[1-{n}]") for i in range(n)]


# Run on node2: bind node2's own address, announce the port, answer one connection.
SERVER = r"""
import os, socket, sys
from pathlib import Path
ready = Path(sys.argv[1])
me = os.environ["SLURMD_NODENAME"]
addr = socket.gethostbyname(me)
with socket.create_server((addr, 0)) as srv:
    srv.settimeout(90)
    tmp = ready.with_suffix(".tmp")
    tmp.write_text(f"{me} {addr} {srv.getsockname()[1]}")
    tmp.rename(ready)
    conn, peer = srv.accept()
    with conn:
        conn.settimeout(30)
        msg = conn.recv(1024).decode()
        conn.sendall(f"{me} heard {msg!r} from {peer[0]}".encode())
print(f"server on {me} bound {addr} heard {msg!r} from {peer[0]}")
"""

# Run on node1: wait for the port, connect to the server by node name, from node1's address.
CLIENT = r"""
import os, socket, sys, time
from pathlib import Path
ready, target = Path(sys.argv[1]), sys.argv[2]
deadline = time.monotonic() + 90
while not ready.exists():
    if time.monotonic() > deadline:
        sys.exit("the server never announced its port")
    time.sleep(0.05)
_, _, port = ready.read_text().split()
me = os.environ["SLURMD_NODENAME"]
with socket.create_connection((target, int(port)), timeout=30, source_address=(socket.gethostbyname(me), 0)) as s:
    s.sendall(f"hello from {me}".encode())
    print(s.recv(1024).decode())
"""


def test_node2_binds_its_address_and_node1_connects_by_name(slurm_cluster, tmp_path):
    assert socket.gethostbyname("node1") == "127.0.0.1"
    assert socket.gethostbyname("node2") == "127.0.0.2"
    ready = tmp_path / "server.ready"
    step = ["srun", "-N1", "-n1", "--time=2"]
    server = subprocess.Popen(
        [*step, "-w", "node2", "-J", "cluster-test-server", sys.executable, "-c", SERVER, str(ready)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        client = run([*step, "-w", "node1", "-J", "cluster-test-client", sys.executable, "-c", CLIENT, str(ready), "node2"], 150)
        server_out, server_err = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()  # srun's death ends its job step
            server.communicate(timeout=30)
    assert client.returncode == 0, client.stderr
    assert server.returncode == 0, server_err
    assert ready.read_text().split()[:2] == ["node2", "127.0.0.2"]
    assert client.stdout.strip() == "node2 heard 'hello from node1' from 127.0.0.1"
    assert server_out.strip() == "server on node2 bound 127.0.0.2 heard 'hello from node1' from 127.0.0.1"


def test_sbatch_array_completes_in_sacct(slurm_cluster, tmp_path):
    job = sbatch(["--array=0-3", "--time=1", "-J", "cluster-test-array", f"--output={tmp_path}/%A_%a.out", "--wrap", 'echo "task $SLURM_ARRAY_TASK_ID"'])
    with cancelled_on_exit(job):
        rows = wait_for_job(job, 120, min_rows=4)
    assert rows == {f"{job}_{i}": "COMPLETED" for i in range(4)}
    assert sorted(p.read_text().strip() for p in tmp_path.glob(f"{job}_*.out")) == [f"task {i}" for i in range(4)]


# The walltime warning reaches the batch shell; its trap requeues the job, which reruns.
REQUEUE_SCRIPT = """#!/bin/bash
echo "start restart=${SLURM_RESTART_COUNT:-0} job=$SLURM_JOB_ID node=$SLURMD_NODENAME"
if [ "${SLURM_RESTART_COUNT:-0}" -ge 1 ]; then
    echo "rerun done"
    exit 0
fi
on_usr2() {
    echo "USR2 after ${SECONDS}s"
    kill "$sleeper" 2>/dev/null
    scontrol requeue "$SLURM_JOB_ID" && echo "requeued"
    exit 0
}
trap on_usr2 USR2
sleep 300 &
sleeper=$!
wait "$sleeper"
echo "the sleep ended without a signal"
"""


def test_walltime_signal_reaches_batch_script_and_requeue_reruns(slurm_cluster, tmp_path):
    """--signal=B:USR2@20 with a 1-minute limit: slurmctld checks limits every 30 s, so the signal
    comes 10-40 s after the start; the rerun starts ~6 s after the requeue (cred_expire=5)."""
    script, log = tmp_path / "requeue.sh", tmp_path / "requeue.out"
    script.write_text(REQUEUE_SCRIPT)
    started = time.monotonic()
    job = sbatch(
        ["--time=00:01:00", "--signal=B:USR2@20", "--requeue", "--open-mode=append", "-J", "cluster-test-requeue", f"--output={log}", str(script)]
    )
    with cancelled_on_exit(job):
        rows = wait_for_job(job, 180)
    text = log.read_text() if log.exists() else "(no output)"
    assert rows == {job: "COMPLETED"}, text
    lines = text.splitlines()
    # Left out: "requeued" (may not get out: the requeue kills the first run) and slurmstepd's
    # "*** JOB n ON node CANCELLED ... DUE TO JOB REQUEUE ***".
    ours = [line for line in lines if line != "requeued" and not line.startswith("slurmstepd")]
    assert len(ours) == 4, text
    assert ours[0].startswith(f"start restart=0 job={job} "), text
    assert ours[1].startswith("USR2 after "), text
    assert ours[2].startswith(f"start restart=1 job={job} ") and ours[3] == "rerun done", text
    print(f"job {job}: {ours[1]}; rerun completed {time.monotonic() - started:.0f} s after sbatch")
