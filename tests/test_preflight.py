"""Preflight checks one by one, on this machine: real nc, iperf3, fio; pure decisions as tables."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from swiftslurm.preflight.checks import allreduce, iperf, local, ports
from swiftslurm.preflight.coord import preflight_ports
from swiftslurm.preflight.report import build_report, print_report, write_report
from swiftslurm.preflight.results import CheckResult, blamed_nodes, decide
from swiftslurm.preflight.run import parse_faults
from swiftslurm.slurm.distenv import free_port

NODES = ["node1", "node2", "node3", "node4"]


def fail(check, node):
    return CheckResult(check, node, False, "bad", "good", "fix it")


def path_without(tmp_path: Path, *tools: str) -> str:
    """A PATH holding links to everything on the real PATH except ``tools``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for d in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            if name not in tools and not (bin_dir / name).exists():
                try:
                    (bin_dir / name).symlink_to(Path(d) / name)
                except OSError:
                    pass
    return str(bin_dir)


# ------------------------------------------------------------------ pure decisions


@pytest.mark.parametrize(
    "failures, blamed",
    [
        ([], []),
        ([fail("nvme", "node3")], ["node3"]),
        # nobody reaches node2: it is in every failing pair, its peers once each
        ([fail("ports", "node1->node2"), fail("ports", "node3->node2"), fail("ports", "node4->node2")], ["node2"]),
        # node4 reaches nobody
        ([fail("ports", "node4->node1"), fail("ports", "node4->node2"), fail("ports", "node4->node3")], ["node4"]),
        # one slow ring pair: both ends are suspects
        ([fail("iperf3", "node2->node3")], ["node2", "node3"]),
        ([fail("allreduce", "all")], []),
        ([fail("ports", "node1->node1")], ["node1"]),
    ],
)
def test_blamed_nodes(failures, blamed):
    assert blamed_nodes(failures + [CheckResult("disk", "node1", True, "ok")]) == blamed


@pytest.mark.parametrize(
    "on_failure, failures, mode, action, proceed, exclude",
    [
        ("abort", [], "train", "continue", True, ()),
        ("abort", [fail("nvme", "node3")], "train", "abort", False, ()),
        ("warn", [fail("nvme", "node3")], "train", "warn", True, ()),
        ("exclude", [fail("nvme", "node3")], "train", "exclude", False, ("node3",)),
        ("exclude", [fail("nvme", "node3")], "preflight", "abort", False, ()),  # a diagnostic run never requeues
        ("exclude", [fail("allreduce", "all")], "train", "abort", False, ()),  # nobody to blame
        ("exclude", [fail("nvme", n) for n in NODES], "train", "abort", False, ()),  # every node: not node-specific
        ("exclude", [fail("nvme", "node9")], "train", "abort", False, ()),  # not in this allocation
    ],
)
def test_decide(on_failure, failures, mode, action, proceed, exclude):
    d = decide(failures, on_failure, NODES, mode)
    assert (d.action, d.proceed, d.exclude) == (action, proceed, exclude)
    assert d.reason


def test_preflight_ports_are_the_rest_of_the_jobs_slot():
    from swiftslurm.slurm.distenv import port_for_job

    for job in range(5000, 5100):
        mp = port_for_job(str(job))
        p = preflight_ports(mp)
        assert sorted(p.values()) == [mp + 1, mp + 2, mp + 3]
        neighbours = {port_for_job(str(job + d)) for d in (-1, 1)}
        assert not set(p.values()) & neighbours  # never the next job's MASTER_PORT


def test_master_port_check_names_a_busy_port_and_the_ephemeral_range():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    busy = holder.getsockname()[1]
    try:
        bad = ports.check_master_port("node1", busy, (busy - 10, busy + 10))
    finally:
        holder.close()
    assert not bad.ok and f"MASTER_PORT {busy} is busy on node1" in bad.observed and "ephemeral range" in bad.observed
    assert "MASTER_PORT in [env]" in bad.hint
    free = ports.check_master_port("node1", busy, None)  # let go: free again
    assert free.ok and not free.hint
    warned = ports.check_master_port("node1", busy, (busy, busy))
    assert warned.ok and "ephemeral range" in warned.observed and warned.hint


def test_parse_faults():
    assert parse_faults("no-listener@node2, kill-allreduce@rank1,bogus@x,hang-allreduce") == {
        ("no-listener", "node2"), ("kill-allreduce", "rank1")}


# ------------------------------------------------------------------ all-reduce (pure parts)


def test_busbw_follows_nccl_tests():
    assert allreduce.bus_bw(10.0, 8) == pytest.approx(17.5)
    assert allreduce.bus_bw(10.0, 2) == pytest.approx(10.0)
    assert allreduce.bus_bw(10.0, 1) == 0.0


def _view(busbw):
    return {"ok": True, "error": "", "sizes": [4096, 65536], "algbw_gbps": [b / 1.5 for b in busbw], "busbw_gbps": busbw, "backend": "gloo"}


def test_judge_names_the_dead_rank_and_folds_the_rest():
    views = {0: {"ok": False, "error": "RuntimeError: Connection closed by peer"}, 1: {"ok": False, "error": "RuntimeError: Connection closed by peer"},
             3: {"ok": False, "error": "x"}}
    out = allreduce.judge(views, [2], NODES, 0, 30)
    assert [(r.check, r.node, r.ok) for r in out] == [("allreduce", "node3", False), ("allreduce", "all", False)]
    assert "rank 2 on node3" in out[0].observed and "node3" in out[0].hint
    assert blamed_nodes(out) == ["node3"]


def test_judge_names_the_stalled_rank():
    views = {r: {"ok": False, "error": "timeout"} for r in range(4)}
    out = allreduce.judge(views, [], NODES, 0, 30, progress={0: 1, 1: 0, 2: 1, 3: 1})
    assert blamed_nodes(out) == ["node2"]
    assert "rank 1 on node2 stalled" in out[0].observed


def test_judge_threshold():
    views = {r: _view([0.5, 2.0]) for r in range(4)}
    ok = allreduce.judge(views, [], NODES, 1.0, 30)
    assert len(ok) == 1 and ok[0].ok and "2.00 GB/s" in ok[0].observed and ok[0].data["sizes"] == [4096, 65536]
    slow = allreduce.judge(views, [], NODES, 5.0, 30)
    assert not slow[0].ok and slow[0].hint and slow[0].expected == "busbw >= 5 GB/s"


def test_allreduce_single_rank_sweep_real():
    import torch.distributed as tdist

    store = tdist.TCPStore("127.0.0.1", free_port(), 1, True, wait_for_workers=False)
    view = allreduce.run_allreduce(0, 1, "gloo", store, 20)
    assert view["ok"], view
    assert view["sizes"] == allreduce.CPU_SIZES and len(view["busbw_gbps"]) == len(view["sizes"])
    assert not tdist.is_initialized()  # destroyed, so the trainer can init its own group


# ------------------------------------------------------------------ ports (real nc)


def test_ports_reachable_and_unreachable():
    port = free_port("127.0.0.2")
    listener, bad = ports.open_listener("node2", port)
    assert bad is None
    try:
        out = ports.check_ports("node1", ["node1", "node2", "node3"], port, master_node="node2")
    finally:
        listener.close()
    by_pair = {r.node: r for r in out}
    assert by_pair["node1->node2"].ok and "MASTER_ADDR" in by_pair["node1->node2"].observed
    bad3 = by_pair["node1->node3"]
    assert not bad3.ok and f"node3:{port} unreachable" in bad3.observed and "node3" in bad3.hint


def test_listener_port_taken_is_a_result():
    port = free_port("127.0.0.3")
    first, _ = ports.open_listener("node3", port)
    try:
        second, bad = ports.open_listener("node3", port)
        assert second is None and not bad.ok and "cannot bind" in bad.observed and bad.hint
    finally:
        first.close()


def test_unresolvable_node_is_a_result():
    listener, bad = ports.open_listener("no-such-node.invalid", 12345)
    assert listener is None and not bad.ok and "does not resolve" in bad.observed


@pytest.mark.parametrize("tool, run", [
    ("nc", lambda: ports.check_ports("node1", NODES, 1, "node1")),
    ("iperf3", lambda: [iperf.measure("node1", "node2", 1, 1.0)]),
    ("fio", lambda: local.check_nvme("node1", "/tmp", 1)),
])
def test_missing_tool_is_a_failed_check_with_install_hint(tmp_path, monkeypatch, tool, run):
    monkeypatch.setenv("PATH", path_without(tmp_path, tool))
    out = run()
    assert len(out) == 1 and not out[0].ok
    assert f"'{tool}' not found" in out[0].observed and "apt-get install" in out[0].hint


def test_gpu_job_without_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", path_without(tmp_path, "nvidia-smi"))
    (r,) = local.check_gpu("node1", 8)
    assert not r.ok and "nvidia-smi" in r.observed and r.hint
    (cpu,) = local.check_gpu("node1", 0)
    assert cpu.ok


# ------------------------------------------------------------------ iperf3 (real)


IPERF3_ERROR = '{"start": {"connected": [], "version": "iperf 3.12"}, "intervals": [], "end": {}, "error": "unable to connect to server: Connection refused"}'


def test_parse_iperf3():
    assert iperf.parse_iperf3_json(IPERF3_ERROR) == (None, "unable to connect to server: Connection refused")
    assert iperf.parse_iperf3_json('{"end": {"sum_received": {"bits_per_second": 3.2e10}}}') == (32.0, "")
    assert iperf.parse_iperf3_json("iperf3: error")[0] is None
    assert iperf.ring_target("node4", NODES) == "node1" and iperf.ring_target("node1", ["node1"]) == "node1"


def test_iperf3_loopback_pass_and_threshold_above_loopback():
    port = free_port("127.0.0.2")
    server, bad = iperf.start_server("node2", port, "127.0.0.2")
    assert bad is None
    try:
        good = iperf.measure("node1", "node2", port, 0.5)
    finally:
        iperf.stop_server(server)
    assert good.ok and good.node == "node1->node2" and good.data["gbps"] > 0.5
    server, _ = iperf.start_server("node2", port, "127.0.0.2")
    try:
        slow = iperf.measure("node1", "node2", port, 100_000)
    finally:
        iperf.stop_server(server)
    assert not slow.ok and "Gbit/s" in slow.observed and "node1->node2" in slow.hint


def test_iperf3_no_server():
    r = iperf.measure("node1", "node3", free_port("127.0.0.3"), 1)
    assert not r.ok and "no measurement" in r.observed and "node3" in r.hint


# ------------------------------------------------------------------ nvme (real fio), disk, gpu parsing


def test_nvme_pass_and_threshold_above_disk(tmp_path):
    (good,) = local.check_nvme("node1", str(tmp_path), 100)
    assert good.ok and good.data["iops"] > 100
    assert ("direct I/O" in good.observed) == good.data["direct"]
    (slow,) = local.check_nvme("node1", str(tmp_path), 10**9)
    assert not slow.ok and "IOPS" in slow.observed and "node1" in slow.hint
    assert not list(tmp_path.iterdir())  # the fio file is cleaned up


NVME_ON_RAMFS = """
import json, sys
from swiftslurm.preflight.checks import local
(r,) = local.check_nvme("node1", sys.argv[1], 1)
print("RESULT " + json.dumps({"ok": r.ok, "observed": r.observed, "data": r.data}))
"""


def test_nvme_without_direct_io_says_so(tmp_path):
    """On a filesystem without O_DIRECT, fio runs buffered and the result says so. tmpfs has O_DIRECT since Linux 6.6;
    ramfs has none: mounted in a private mount namespace (root: CI runs as root), gone when the check ends."""
    ramfs = tmp_path / "ramfs"
    ramfs.mkdir()
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:  # a failure under CI=true (tests/conftest.py)
        pytest.skip(f"no mount namespace for this user (unshare -m needs root): {probe.stderr.decode()[-200:]}")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", 'mount -t ramfs none "$0" && exec "$@"', str(ramfs), sys.executable, "-c", NVME_ON_RAMFS,
                           str(ramfs)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert local.direct_io_supported(str(ramfs))[0]  # outside the namespace the plain folder: O_DIRECT works there
    assert r["ok"] and "BUFFERED, O_DIRECT not supported here (Invalid argument)" in r["observed"] and not r["data"]["direct"], r


def test_nvme_bad_path():
    (r,) = local.check_nvme("node1", "/no/such/dir", 1)
    assert not r.ok and "nvme_path" in r.hint


def test_disk(tmp_path):
    (ok,) = local.check_disk("node1", str(tmp_path / "not-yet"), 0.001)
    assert ok.ok and ok.data["free_gb"] > 0
    (bad,) = local.check_disk("node1", str(tmp_path), 10**9)
    assert not bad.ok and bad.hint


NVSMI = "0, NVIDIA H200, 143771, 1, 0\n1, NVIDIA H200, 143771, 1, [N/A]\n"


def test_gpu_judgement():
    gpus = local.parse_nvidia_smi(NVSMI)
    assert [g["memory_total_mib"] for g in gpus] == [143771, 143771]
    assert local.judge_gpus("n", gpus, 2)[0].ok
    assert not local.judge_gpus("n", gpus, 8)[0].ok
    sick = local.parse_nvidia_smi("0, NVIDIA H200, 143771, 1, 3\n")
    assert "uncorrected ECC" in local.judge_gpus("n", sick, 1)[0].observed


def test_sharedfs(tmp_path):
    f = tmp_path / ".nonce"
    f.write_text("abc")
    assert local.read_nonce("n", f, "abc")[0].ok
    assert not local.read_nonce("n", f, "xyz")[0].ok
    assert not local.read_nonce("n", tmp_path / "missing", "abc")[0].ok


# ------------------------------------------------------------------ report


def test_report_json_png_table(tmp_path):
    from rich.console import Console

    views = {r: _view([0.5, 2.0]) for r in range(2)}
    results = allreduce.judge(views, [], ["node1", "node2"], 0, 30) + [fail("nvme", "node2")]
    d = decide(results, "abort", ["node1", "node2"])
    path = write_report(tmp_path, build_report(results, d, {"job_id": "7", "nodes": ["node1", "node2"], "wall_s": 3.2}))
    data = json.loads(path.read_text())
    assert data["ok"] is False and data["failed"] == 1 and data["decision"]["action"] == "abort"
    assert data["busbw"]["busbw_gbps"] == [0.5, 2.0]
    png = tmp_path / "preflight" / "busbw.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    console = Console(record=True, width=200)
    print_report(console, data)
    text = console.export_text()
    assert "FAIL" in text and "fix it" in text and "wall time 3.2 s" in text


# ------------------------------------------------------------------ the gate, one process (fast)


@pytest.mark.parametrize("on_failure, proceed, action", [("abort", False, "abort"), ("warn", True, "warn"), ("exclude", False, "abort")])
def test_gate_on_failure(tmp_path, on_failure, proceed, action, capsys):
    from swiftslurm.preflight import gate
    from swiftslurm.slurm.distenv import derive
    from swiftslurm.spec import parse_spec

    spec = parse_spec(
        f'[job]\noutput_dir = "{tmp_path}"\n[train]\ncommand = ["true"]\n'
        f'[preflight]\nchecks = ["disk", "sharedfs"]\nmin_disk_free_gb = 1e9\non_failure = "{on_failure}"\n'
    )
    dist = derive({"MASTER_PORT": str(free_port())}, pid=os.getpid())
    assert gate(dist, spec, str(tmp_path), mode="train") is proceed
    report = json.loads((tmp_path / "preflight" / "report.json").read_text())  # kept, whatever the decision
    assert report["decision"]["action"] == action and report["failed"] == 1
    assert [r["check"] for r in report["results"] if r["ok"]] == ["sharedfs"]
    if on_failure == "exclude":  # excluding the only node would leave nothing to run on: say so instead
        assert "not node-specific; not requeueing" in report["decision"]["reason"]
    if on_failure == "warn":
        assert "WARNING" in capsys.readouterr().err


def test_gate_without_checks_is_a_no_op(tmp_path):
    from swiftslurm.preflight import checks_for, gate
    from swiftslurm.spec import parse_spec

    spec = parse_spec('[train]\ncommand = ["true"]\n[preflight]\nchecks = []\n')
    assert gate(None, spec, str(tmp_path), mode="train") is True and not (tmp_path / "preflight").exists()
    assert "allreduce" in checks_for(spec, "preflight")  # a diagnostic run with [] runs every check


def test_check_names_have_one_source():
    """The spec's field, the preflight-only default and the README's reference all read spec.CHECKS."""
    from swiftslurm.errors import SpecError
    from swiftslurm.preflight import checks_for
    from swiftslurm.spec import CHECKS, parse_spec
    from swiftslurm.spec.doc import DESCRIPTIONS

    spec = parse_spec('[train]\ncommand = ["true"]\n[preflight]\nchecks = []\n')
    assert checks_for(spec, "preflight") == list(CHECKS)
    assert parse_spec(f'[train]\ncommand = ["true"]\n[preflight]\nchecks = {list(CHECKS)!r}\n'.replace("'", '"')).preflight.checks == list(CHECKS)
    with pytest.raises(SpecError):
        parse_spec('[train]\ncommand = ["true"]\n[preflight]\nchecks = ["topology"]\n')
    assert all(f"`{name}`" in DESCRIPTIONS["preflight.checks"] for name in CHECKS)


def test_exclusion_ends_once_the_job_was_requeued_max_requeues_times():
    """A node that keeps failing (or an exclusion Slurm keeps refusing) must end the job, not requeue it forever."""
    from types import SimpleNamespace

    from swiftslurm.preflight.gate import exclusion_allowed
    from swiftslurm.preflight.results import Decision

    exclude = Decision("exclude", False, ("node2",), "excluding node2 and requeueing: ...")
    spec = SimpleNamespace(slurm=SimpleNamespace(max_requeues=2))
    for restarts, action in ((0, "exclude"), (1, "exclude"), (2, "abort"), (7, "abort")):
        d = exclusion_allowed(exclude, SimpleNamespace(executor="slurm", restart_count=restarts), spec)
        assert d.action == action and (action == "exclude" or "max_requeues = 2" in d.reason)
    local = exclusion_allowed(exclude, SimpleNamespace(executor="local", restart_count=0), spec)
    assert local.action == "abort" and "needs Slurm" in local.reason
    keep = Decision("warn", True, reason="x")
    assert exclusion_allowed(keep, SimpleNamespace(executor="slurm", restart_count=9), spec) is keep


def test_required_nodes_are_never_excluded():
    from swiftslurm import slurm

    show = "JobId=5 JobName=x ReqNodeList=node[1-2] ExcNodeList=(null) NodeList=node[1-2]"
    assert slurm.parse_req_node_list(show) == "node[1-2]" and slurm.parse_exc_node_list(show) == ""
    assert slurm.required_among("node[1-2]", ["node2", "node3"]) == ["node2"]
    assert slurm.required_among("", ["node2"]) == []
