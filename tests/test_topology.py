"""Topology awareness: the pure parsers on text in the real tools' formats (tests/data/topology, see its
README), the sysfs reader on a fake /sys/class/infiniband tree, and the socket-fallback verdict."""

from __future__ import annotations

from pathlib import Path

import pytest

from swiftslurm.preflight.checks.topology import judge_transport, parse_nccl_transport, parse_topo_matrix, read_ib_ports

DATA = Path(__file__).parent / "data" / "topology"


def text(name: str) -> str:
    return (DATA / name).read_text()


def test_nvlink_matrix_with_a_nic_legend():
    topo = parse_topo_matrix(text("topo_nvlink_8gpu.txt"))
    assert topo == {"gpus": 8, "interconnect": "NVLink", "nvlinks": 18, "pcie_paths": [],
                    "nics": ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]}


def test_pcie_matrix_of_an_older_driver_names_its_paths_and_the_nic_column():
    topo = parse_topo_matrix(text("topo_pcie_4gpu_legacy.txt"))
    assert topo == {"gpus": 4, "interconnect": "PCIe", "nvlinks": 0, "pcie_paths": ["PHB", "PIX", "SYS"], "nics": ["mlx5_0"]}


def test_one_gpu_mixed_links_and_no_matrix():
    assert parse_topo_matrix(text("topo_single_gpu.txt"))["interconnect"] == "single GPU"
    mixed = "\tGPU0\tGPU1\tGPU2\tCPU Affinity\nGPU0\t X \tNV4\tSYS\t0-7\nGPU1\tNV4\t X \tSYS\t0-7\nGPU2\tSYS\tSYS\t X \t8-15\n"
    assert parse_topo_matrix(mixed)["interconnect"] == "mixed"
    assert parse_topo_matrix("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")["interconnect"] == ""


def test_one_gpu_as_nvidia_smi_prints_it_is_one_gpu_never_no_gpus():
    """topo_h200_1gpu_ansi.txt is `nvidia-smi topo -m` of the project's H200 node (driver 580), byte for byte:
    the header underlined with ANSI escapes even into a file. One GPU has no pair: still one GPU."""
    raw = text("topo_h200_1gpu_ansi.txt")
    assert "\x1b[4m" in raw  # the capture keeps the escapes the parser has to see through
    topo = parse_topo_matrix(raw)
    assert topo == {"gpus": 1, "interconnect": "single GPU", "nvlinks": 0, "pcie_paths": [], "nics": []}
    seen = judge_transport("gpu-h200", [], None, False, topo)
    assert seen.ok and seen.observed == "1 GPU (no interconnect to check); no active IB/RoCE port"
    assert "no GPUs" not in seen.observed
    # the same escapes around an 8-GPU header: the matrix is still read
    underlined = text("topo_nvlink_8gpu.txt").replace("\tGPU0", "\t\x1b[4mGPU0", 1)
    assert parse_topo_matrix(underlined) == parse_topo_matrix(text("topo_nvlink_8gpu.txt"))
    # a matrix we cannot read is "unknown", not zero GPUs
    unread = judge_transport("gpu-h200", [], None, False, parse_topo_matrix("NVIDIA-SMI has failed"))
    assert "GPU interconnect unknown" in unread.observed and "no GPUs" not in unread.observed


def test_nccl_on_roce_and_on_sockets():
    roce = parse_nccl_transport(text("nccl_roce.txt"))
    assert roce == {"network": "IB", "net_devices": ["mlx5_0:1/RoCE", "mlx5_1:1/RoCE"], "via": ["NET/IB", "P2P/CUMEM"],
                    "ib_disabled": False}
    sock = parse_nccl_transport(text("nccl_socket_fallback.txt"))
    assert sock == {"network": "Socket", "net_devices": ["eno1"], "via": ["NET/Socket", "P2P/CUMEM"], "ib_disabled": True}
    assert parse_nccl_transport("")["network"] == ""


def fake_sysfs(root: Path, ports: dict[str, tuple[str, str, str, str]]) -> Path:
    """/sys/class/infiniband as the kernel lays it out: <dev>/ports/<n>/{state,phys_state,link_layer,rate}."""
    for name, (state, phys, layer, rate) in ports.items():
        dev, port = name.split(":")
        d = root / dev / "ports" / port
        d.mkdir(parents=True)
        (d / "state").write_text(state + "\n")
        (d / "phys_state").write_text(phys + "\n")
        (d / "link_layer").write_text(layer + "\n")
        (d / "rate").write_text(rate + "\n")
    return root


def test_sysfs_reader(tmp_path):
    root = fake_sysfs(tmp_path / "infiniband", {
        "mlx5_0:1": ("4: ACTIVE", "5: LinkUp", "InfiniBand", "400 Gb/sec (4X NDR)"),
        "mlx5_1:1": ("1: DOWN", "3: Disabled", "Ethernet", "40 Gb/sec (4X QDR)"),
    })
    assert read_ib_ports(root) == [
        {"device": "mlx5_0", "port": "1", "state": "ACTIVE", "phys_state": "LinkUp", "link_layer": "InfiniBand", "rate": "400 Gb/sec (4X NDR)"},
        {"device": "mlx5_1", "port": "1", "state": "DOWN", "phys_state": "Disabled", "link_layer": "Ethernet", "rate": "40 Gb/sec (4X QDR)"},
    ]
    assert read_ib_ports(tmp_path / "absent") == []


@pytest.mark.parametrize("layer,gid_hint", [("InfiniBand", False), ("Ethernet", True)])
def test_a_fabric_nccl_did_not_use_fails_with_the_fix(tmp_path, layer, gid_hint):
    ports = read_ib_ports(fake_sysfs(tmp_path / "ib", {"mlx5_0:1": ("4: ACTIVE", "5: LinkUp", layer, "200 Gb/sec (4X HDR)")}))
    topo = parse_topo_matrix(text("topo_nvlink_8gpu.txt"))
    bad = judge_transport("gpu-a07", ports, parse_nccl_transport(text("nccl_socket_fallback.txt")), True, topo)
    assert not bad.ok and bad.check == "topology"
    assert "8 GPU(s) over NVLink (NV18)" in bad.observed and "NCCL between nodes: Socket" in bad.observed
    assert "NCCL_IB_DISABLE=0" in bad.hint and "NCCL_SOCKET_IFNAME" in bad.hint and "NCCL_IB_HCA=mlx5_0" in bad.hint
    assert ("NCCL_IB_GID_INDEX" in bad.hint) == gid_hint
    assert bad.data["ib_ports"] == ports
    good = judge_transport("gpu-a07", ports, parse_nccl_transport(text("nccl_roce.txt")), True, topo)
    assert good.ok and "NCCL between nodes: IB" in good.observed


def test_no_fabric_one_node_or_a_down_port_is_no_failure(tmp_path):
    sock = parse_nccl_transport(text("nccl_socket_fallback.txt"))
    assert judge_transport("n1", [], sock, True).ok  # sockets are all there is
    down = read_ib_ports(fake_sysfs(tmp_path / "ib", {"mlx5_0:1": ("1: DOWN", "3: Disabled", "InfiniBand", "")}))
    assert judge_transport("n1", down, sock, True).ok
    up = [{**down[0], "state": "ACTIVE"}]
    assert judge_transport("n1", up, sock, False).ok  # one node: NCCL never goes between nodes


def test_each_nodes_reading_is_judged_with_the_transport_of_its_own_ranks(tmp_path):
    from swiftslurm.preflight.checks.topology import combine

    ports = read_ib_ports(fake_sysfs(tmp_path / "ib", {"mlx5_0:1": ("4: ACTIVE", "5: LinkUp", "Ethernet", "100 Gb/sec (4X EDR)")}))
    readings = [judge_transport(n, ports, None, False, parse_topo_matrix(text("topo_single_gpu.txt"))) for n in ("n1", "n2")]
    assert all(r.ok and "NCCL" not in r.observed for r in readings)  # before the all-reduce: a reading, no verdict
    sock, roce = parse_nccl_transport(text("nccl_socket_fallback.txt")), parse_nccl_transport(text("nccl_roce.txt"))
    judged = combine(readings, {0: roce, 1: roce, 2: None, 3: sock}, ["n1", "n1", "n2", "n2"], True)
    assert [(r.node, r.ok) for r in judged] == [("n1", True), ("n2", False)]
    assert "NCCL_IB_GID_INDEX" in judged[1].hint and "1 GPU (no interconnect to check)" in judged[1].observed


def test_the_nccl_log_is_captured_only_where_a_fabric_could_be_missed(tmp_path):
    from swiftslurm.preflight.checks.topology import capture_nccl, read_nccl_log

    active = fake_sysfs(tmp_path / "ib", {"mlx5_0:1": ("4: ACTIVE", "5: LinkUp", "InfiniBand", "")})
    env: dict[str, str] = {}
    assert capture_nccl(env, "7", 0, False, str(tmp_path), active) is None and env == {}  # one node
    assert capture_nccl(env, "7", 0, True, str(tmp_path), tmp_path / "none") is None and env == {}  # no fabric
    assert capture_nccl({"NCCL_DEBUG": "WARN"}, "7", 0, True, str(tmp_path), active) is None  # the user's choice stands
    path = capture_nccl(env, "7", 3, True, str(tmp_path), active)
    assert env == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": str(path)}
    assert read_nccl_log(path) is None  # NCCL never wrote it (a failed init)
    path.write_text(text("nccl_roce.txt"))
    assert read_nccl_log(path)["network"] == "IB"
