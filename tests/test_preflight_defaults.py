"""Defaults that pass a healthy production cluster (issue 22 item 6): iperf3 with parallel streams on the interface
NCCL uses, the nvme check where the job writes, only the job's own GPUs, and a default floor that only warns."""

from __future__ import annotations

import json
import os

import pytest

from swiftslurm.errors import SpecError
from swiftslurm.preflight import ifaces
from swiftslurm.preflight.checks import iperf, local
from swiftslurm.preflight.results import CheckResult, decide
from swiftslurm.spec import parse_spec
from tests.test_preflight import free_port

# ------------------------------------------------------------------ spec keys


def test_preflight_defaults_and_new_keys():
    pf = parse_spec("[preflight]\n").preflight
    assert (pf.iperf3_streams, pf.iperf3_duration_s, pf.nvme_path) == (8, 3, None)
    assert pf.iperf3_floor == (20.0, False) and pf.nvme_floor == (50000, False)  # default floors: warn only
    pf = parse_spec("[preflight]\nmin_iperf3_gbps = 5\nmin_nvme_iops = 10\niperf3_streams = 2\niperf3_duration_s = 10\n").preflight
    assert pf.iperf3_floor == (5.0, True) and pf.nvme_floor == (10, True) and pf.iperf3_streams == 2


@pytest.mark.parametrize("line, where", [
    ("iperf3_streams = 0", "preflight.iperf3_streams"), ("iperf3_streams = 1000", "preflight.iperf3_streams"),
    ("iperf3_duration_s = 0", "preflight.iperf3_duration_s"), ("iperf3_duration_s = 2.5", "preflight.iperf3_duration_s"),
    ("min_iperf3_gbps = -1", "preflight.min_iperf3_gbps"), ("nvme_path = ''", "preflight.nvme_path"),
])
def test_bad_preflight_values_are_named(line, where):
    with pytest.raises(SpecError) as exc:
        parse_spec(f"[preflight]\n{line}\n")
    assert where in {p.path for p in exc.value.problems}


# ------------------------------------------------------------------ decisions: hard failures abort, default floors warn


def soft(check, node):
    return CheckResult(check, node, False, "slow", ">= 20 (default floor: warns only)", "set it", warn_only=True)


def hard(check, node):
    return CheckResult(check, node, False, "unreachable", "reachable", "fix it")


def test_a_default_floor_missed_only_warns_even_under_abort():
    d = decide([soft("iperf3", "node1->node2"), soft("nvme", "node2")], "abort", ["node1", "node2"])
    assert d.action == "warn" and d.proceed and "default floor" in d.reason
    d = decide([soft("iperf3", "node1->node2")], "exclude", ["node1", "node2"], mode="preflight")
    assert d.action == "warn" and d.proceed  # the diagnostic passes too (exit 0), the table says WARN


def test_a_hard_failure_still_aborts_next_to_warnings():
    d = decide([soft("nvme", "node2"), hard("ports", "node1->node2")], "abort", ["node1", "node2"])
    assert d.action == "abort" and not d.proceed and "nvme" not in d.reason
    d = decide([soft("nvme", "node1"), hard("ports", "node2")], "exclude", ["node1", "node2"])
    assert d.action == "exclude" and d.exclude == ("node2",)  # a warning blames nobody


def test_report_counts_warnings_apart(tmp_path):
    from rich.console import Console

    from swiftslurm.preflight.report import build_report, print_report

    results = [soft("nvme", "node1"), CheckResult("ports", "node1", True, "ok")]
    report = build_report(results, decide(results, "abort", ["node1"]), {"nodes": ["node1"]})
    assert report["ok"] and report["failed"] == 0 and report["warnings"] == 1
    console = Console(record=True, width=200)
    print_report(console, report)
    text = console.export_text()
    assert "WARN" in text and "FAIL" not in text and "1 warning(s)" in text


# ------------------------------------------------------------------ iperf3: streams, duration, the NCCL interface


def test_iperf3_parallel_streams_and_duration_real():
    port = free_port("127.0.0.2")
    server, bad = iperf.start_server("node2", port, "127.0.0.2")
    assert bad is None
    try:
        r = iperf.measure("node1", "node2", port, 100_000, binding=False, streams=3, duration_s=1, src_addr="127.0.0.1", dst_addr="127.0.0.2")
    finally:
        iperf.stop_server(server)
    assert r.data["streams"] == 3 and r.data["duration_s"] == 1 and r.data["gbps"] > 0
    assert "3 streams x 1 s" in r.observed and "127.0.0.1 -> 127.0.0.2" in r.observed
    assert not r.ok and r.warn_only and "warns only" in r.expected and "set preflight.min_iperf3_gbps" in r.hint


@pytest.mark.parametrize("spec, names, chosen", [
    ("eth", ["lo", "eth0", "eth1", "ib0"], ["eth0", "eth1"]),
    ("=eth0", ["eth0", "eth01"], ["eth0"]),
    ("^docker,lo", ["lo", "docker0", "ens5", "ib0"], ["ens5", "ib0"]),
    ("^=eth0", ["eth0", "eth01"], ["eth01"]),
    ("ib0,ens", ["ens1f0", "ib0", "ib1"], ["ens1f0", "ib0"]),
    ("bond", ["eth0"], []),
])
def test_match_ifname_reads_nccl_syntax(spec, names, chosen):
    assert ifaces.match_ifname(spec, names) == chosen


HOST = [("lo", "127.0.0.1"), ("eth0", "10.0.0.5"), ("ib0", "192.168.10.5"), ("ib0", "192.168.11.5")]


def test_pick_address_follows_nccl():
    assert ifaces.pick_address({"NCCL_SOCKET_IFNAME": "eth"}, HOST, "10.0.0.5") == ("10.0.0.5", "eth0", "")
    assert ifaces.pick_address({"NCCL_SOCKET_IFNAME": "ib0"}, HOST, "10.0.0.5") == ("192.168.10.5", "ib0", "")
    assert ifaces.pick_address({"NCCL_SOCKET_IFNAME": "ib0"}, HOST, "192.168.11.5") == ("192.168.11.5", "ib0", "")
    assert ifaces.pick_address({}, HOST, "10.0.0.5") == ("192.168.10.5", "ib0", "")  # NCCL prefers IPoIB
    assert ifaces.pick_address({}, HOST[:2], "10.0.0.5") == ("10.0.0.5", "", "")  # else the node-name address
    addr, _, err = ifaces.pick_address({"NCCL_SOCKET_IFNAME": "bond"}, HOST, "10.0.0.5")
    assert addr is None and "NCCL_SOCKET_IFNAME='bond'" in err and "eth0 (10.0.0.5)" in err


def test_interface_addresses_of_this_host():
    found = ifaces.interface_addresses()
    assert ("lo", "127.0.0.1") in found


def test_an_ifname_no_interface_matches_is_a_hard_failure_naming_the_node():
    addr, iface, bad = iperf.local_address("node1", {"NCCL_SOCKET_IFNAME": "nosuchnic"})
    assert addr is None and bad is not None and not bad.ok and not bad.warn_only
    assert bad.node == "node1" and "nosuchnic" in bad.observed and "NCCL_SOCKET_IFNAME" in bad.hint
    addr, iface, bad = iperf.local_address("node1", {"NCCL_SOCKET_IFNAME": "lo"})
    assert (addr, iface, bad) == ("127.0.0.1", "lo", None)


# ------------------------------------------------------------------ nvme: where the job writes


def test_nvme_target_is_the_offload_path_else_the_checkpoint_dir():
    from swiftslurm import dsconfig

    ds, _ = dsconfig.build_for_spec(parse_spec('[train]\nmodel = "tiny-llama"\ndataset = ["d.jsonl"]\ndeepspeed = "zero3_nvme"\nbf16 = true\n'
                                               '[deepspeed]\nzero_optimization = { offload_optimizer = { nvme_path = "/local/nvme" } }\n'))
    assert local.nvme_target(ds, "/shared/out") == ("/local/nvme", "the DeepSpeed offload_optimizer nvme_path")
    ds, _ = dsconfig.build_for_spec(parse_spec('[train]\nmodel = "tiny-llama"\ndataset = ["d.jsonl"]\n'))
    assert local.nvme_target(ds, "/shared/out") == ("/shared/out", "the checkpoint dir")
    assert local.nvme_target(None, "/shared/out")[0] == "/shared/out"


def _gate(tmp_path, preflight: str, ds_config=None):
    from swiftslurm.preflight import gate
    from swiftslurm.slurm.distenv import derive

    spec = parse_spec(f'[job]\noutput_dir = "{tmp_path}"\n[preflight]\n{preflight}\n')
    dist = derive({"MASTER_PORT": str(free_port())}, pid=os.getpid())
    proceed = gate(dist, spec, str(tmp_path), mode="train", ds_config=ds_config)
    return proceed, json.loads((tmp_path / "preflight" / "report.json").read_text())


def test_gate_tests_the_checkpoint_dir_and_a_missed_default_floor_trains(tmp_path, monkeypatch):
    import swiftslurm.spec.model as model

    monkeypatch.setattr(model, "DEFAULT_MIN_NVME_IOPS", 10**9)  # a floor no disk reaches, still the unset default
    proceed, report = _gate(tmp_path, 'checks = ["nvme"]\non_failure = "abort"')
    [r] = report["results"]
    assert proceed and report["decision"]["action"] == "warn" and report["ok"] and report["warnings"] == 1
    assert str(tmp_path) in r["observed"] and r["warn_only"]


def test_gate_a_floor_the_user_set_fails(tmp_path):
    offload = {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}}
    proceed, report = _gate(tmp_path, 'checks = ["nvme"]\nmin_nvme_iops = 1000000000', ds_config=offload)
    assert not proceed and report["decision"]["action"] == "abort" and report["failed"] == 1


# ------------------------------------------------------------------ gpu: only the job's own

FAKE_SMI = """#!/bin/sh
# four GPUs on the node; GPU 0 belongs to another job and holds memory
cat <<'OUT'
0, NVIDIA H200, 143771, 90000, 0, GPU-aaaa
1, NVIDIA H200, 143771, 1, 0, GPU-bbbb
2, NVIDIA H200, 143771, 1, 0, GPU-cccc
3, NVIDIA H200, 143771, 1, 0, GPU-dddd
OUT
"""


@pytest.fixture()
def smi_path(tmp_path, monkeypatch):
    bin_dir = tmp_path / "smi-bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.parametrize("env", [{"SLURM_JOB_GPUS": "1,2"}, {"SLURM_STEP_GPUS": "2,3", "SLURM_JOB_GPUS": "0,1"},
                                 {"CUDA_VISIBLE_DEVICES": "GPU-bbbb,GPU-dddd"}])
def test_gpu_check_judges_only_the_jobs_gpus(smi_path, env):
    [r] = local.check_gpu("node1", 2, 10, env)
    assert r.ok, r.observed
    assert r.observed.startswith("2 x NVIDIA H200")


def test_gpu_check_still_sees_its_own_busy_or_missing_gpu(smi_path):
    [busy] = local.check_gpu("node1", 2, 10, {"SLURM_JOB_GPUS": "0,1"})
    assert not busy.ok and "GPU 0 already uses" in busy.observed
    [missing] = local.check_gpu("node1", 3, 10, {"SLURM_JOB_GPUS": "1,2"})
    assert not missing.ok and "2 GPU(s) visible" in missing.observed


def test_job_gpu_ids_and_renumbered_cgroup_view():
    assert local.job_gpu_ids({}) is None and local.job_gpu_ids({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}) is None
    rows = local.parse_nvidia_smi("0, H200, 1, 1, 0, GPU-x\n1, H200, 1, 1, 0, GPU-y\n")
    assert local.own_gpus(rows, ["4", "5"]) == rows  # cgroups show only the job's two, numbered from 0
    assert local.own_gpus(rows, ["1"]) == rows[1:]
