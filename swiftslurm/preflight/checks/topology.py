"""Topology awareness: each node's GPU interconnect, its InfiniBand/RoCE ports, and the transport NCCL chose.

Three readings, each parsed by a pure function tested on text in the real formats (tests/data/topology):

- ``nvidia-smi topo -m``: the GPU x GPU matrix; ``NV<n>`` cells are NVLink (n bonded links), ``PIX``,
  ``PXB``, ``PHB``, ``NODE``, ``SYS`` are PCIe paths (``parse_topo_matrix``);
- ``/sys/class/infiniband/<dev>/ports/<n>/{state,phys_state,link_layer,rate}``: the RDMA ports, InfiniBand
  or Ethernet (RoCE), and whether they are ACTIVE (``read_ib_ports``, over any root: a fake tree in tests);
- ``NCCL_DEBUG=INFO`` lines of the all-reduce: ``NET/IB : Using [0]mlx5_0:1/IB ...`` or ``NET/Socket :
  Using [0]eth0:...``, ``Using network IB|Socket``, and the ``Channel ... via NET/IB/0`` /
  ``via P2P/IPC`` transports (``parse_nccl_transport``).

``judge_transport`` turns one node's readings into a ``CheckResult``: an ACTIVE IB/RoCE port while NCCL
used sockets between nodes fails, with the settings that fix it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, MutableMapping

from ...fsutil import MIB, open_regular
from ..results import CheckResult

NCCL_LOG_CAP = 16 * MIB  # the head of NCCL's debug log read for its transport lines

SYSFS_IB = "/sys/class/infiniband"
PCIE_LINKS = ("PIX", "PXB", "PHB", "NODE", "SYS")
# nvidia-smi underlines the matrix header with ANSI escapes even into a pipe (`\t\x1b[4mGPU0\t...\x1b[0m`)
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def parse_topo_matrix(text: str) -> dict[str, Any]:
    """``nvidia-smi topo -m`` output -> ``{"gpus", "interconnect", "nvlinks", "pcie_paths", "nics"}`` (pure).

    ``interconnect`` is "NVLink" when every GPU pair is NV#, "PCIe" when none is, "mixed" otherwise,
    "single GPU" for one GPU (no pair, nothing to check) and "" when no matrix was found. ``nics`` are the
    RDMA devices the matrix names (the "NIC Legend" of recent drivers, or mlx5_* column headers of older
    ones). ANSI escapes (the header's underline) are dropped first."""
    lines = [ln.rstrip() for ln in ANSI_ESCAPE.sub("", text).splitlines()]
    header_i = next((i for i, ln in enumerate(lines) if re.match(r"^\s+GPU0\b", ln)), None)
    if header_i is None:
        return {"gpus": 0, "interconnect": "", "nvlinks": 0, "pcie_paths": [], "nics": []}
    columns = lines[header_i].split()
    gpu_cols = [c for c in columns if re.fullmatch(r"GPU\d+", c)]
    links: list[str] = []
    for ln in lines[header_i + 1:]:
        cells = ln.split()
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]):
            if cells and not re.fullmatch(r"(NIC\d+|mlx\S+)", cells[0]):
                break
            continue
        row = cells[0]
        for col, cell in zip(gpu_cols, cells[1:1 + len(gpu_cols)], strict=False):
            if col != row and int(col[3:]) > int(row[3:]):
                links.append(cell)
    nvlinks = [int(c[2:]) for c in links if re.fullmatch(r"NV\d+", c)]
    legend = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)\s*$", text, re.M))
    nics = [legend.get(c, c) for c in columns if re.fullmatch(r"NIC\d+", c) or c.startswith("mlx")]
    if len(gpu_cols) <= 1:
        kind = "single GPU"
    elif links and len(nvlinks) == len(links):
        kind = "NVLink"
    elif not nvlinks:
        kind = "PCIe"
    else:
        kind = "mixed"
    return {"gpus": len(gpu_cols), "interconnect": kind, "nvlinks": min(nvlinks) if nvlinks else 0,
            "pcie_paths": sorted({c for c in links if c in PCIE_LINKS}), "nics": nics}


def read_ib_ports(root: str | Path = SYSFS_IB) -> list[dict[str, str]]:
    """Every RDMA port under ``root`` (``/sys/class/infiniband``): device, port, state, phys_state,
    link_layer ("InfiniBand" or "Ethernet" = RoCE) and rate; [] when there is none. Reads files only."""
    root = Path(root)
    out: list[dict[str, str]] = []
    try:
        devices = sorted(p for p in root.iterdir())
    except OSError:
        return []
    for dev in devices:
        try:
            ports = sorted((dev / "ports").iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 0)
        except OSError:
            continue
        for port in ports:
            def read(name: str, port: Path = port) -> str:
                try:
                    return (port / name).read_text().strip()
                except OSError:
                    return ""
            out.append({"device": dev.name, "port": port.name, "state": _strip_code(read("state")),
                        "phys_state": _strip_code(read("phys_state")), "link_layer": read("link_layer"), "rate": read("rate")})
    return out


def _strip_code(value: str) -> str:
    """``4: ACTIVE`` -> ``ACTIVE``; ``5: LinkUp`` -> ``LinkUp`` (sysfs prefixes the enum number)."""
    return value.split(":", 1)[1].strip() if ":" in value else value


def parse_nccl_transport(text: str) -> dict[str, Any]:
    """NCCL_DEBUG=INFO lines -> ``{"network", "net_devices", "via", "ib_disabled"}`` (pure).

    ``network`` is what NCCL chose for traffic between nodes ("IB", "Socket", or "" when the log does not say);
    ``net_devices`` the devices of its "NET/<name> : Using" line (``mlx5_0:1/RoCE``, ``eth0``); ``via`` the
    transports its channels used (``P2P/IPC``, ``SHM``, ``NET/IB``, ``NET/Socket``...)."""
    network = ""
    devices: list[str] = []
    via: set[str] = set()
    ib_disabled = False
    for line in text.splitlines():
        m = re.search(r"NCCL INFO Using network (\w+)", line)
        if m:
            network = m.group(1)
        m = re.search(r"NCCL INFO NET/(IB|Socket) : Using (.*?)(?:;|$)", line)
        if m:
            devices = re.findall(r"\[\d+\](\S+?)(?::[\d.]+<\d+>)?(?=\s|$)", m.group(2))
            if not network and "Using network" not in text:
                network = m.group(1)
        m = re.search(r"NCCL INFO Channel .* via (\S+)", line)
        if m:
            parts = m.group(1).split("/")
            via.add("/".join(parts[:2]) if parts[0] in ("NET", "P2P") else parts[0])
        if re.search(r"NCCL_IB_DISABLE set by environment to [1-9]", line):
            ib_disabled = True
    if any(v.startswith("NET/Socket") for v in via) and not any(v.startswith("NET/IB") for v in via):
        network = network or "Socket"
    return {"network": network, "net_devices": devices, "via": sorted(via), "ib_disabled": ib_disabled}


def gpu_summary(topo: dict[str, Any]) -> str:
    """The GPU half of a ``topology`` observation (pure): ``8 GPU(s) over NVLink (NV18)``, ``1 GPU (no
    interconnect to check)``, ``no GPUs in this job`` (read_node's ``interconnect == "none"``) or, when
    ``nvidia-smi topo -m`` gave no matrix, "unknown": never "no GPUs" for a matrix we could not read."""
    kind = topo.get("interconnect", "")
    if kind == "single GPU":
        return "1 GPU (no interconnect to check)"
    if kind == "none":
        return "no GPUs in this job (slurm.gpus_per_node = 0)"
    if kind:
        return f"{topo.get('gpus', 0)} GPU(s) over {kind}" + (f" (NV{topo['nvlinks']})" if topo.get("nvlinks") else "")
    return "GPU interconnect unknown (no matrix from `nvidia-smi topo -m`)"


def judge_transport(node: str, ib_ports: list[dict[str, str]], nccl: dict[str, Any] | None, multi_node: bool,
                    topo: dict[str, Any] | None = None) -> CheckResult:
    """One node's topology finding (pure). Fails when an ACTIVE IB/RoCE port exists but NCCL used sockets
    between nodes; otherwise reports what was seen."""
    active = [p for p in ib_ports if p.get("state") == "ACTIVE"]
    roce = [p for p in active if p.get("link_layer") == "Ethernet"]
    fabric = ", ".join(f"{p['device']}:{p['port']} {'RoCE' if p.get('link_layer') == 'Ethernet' else 'IB'} {p.get('rate', '')}".strip()
                       for p in active) or "no active IB/RoCE port"
    gpus = topo or {}
    gpu_text = gpu_summary(gpus)
    net = (nccl or {}).get("network", "")
    observed = f"{gpu_text}; {fabric}" + (f"; NCCL between nodes: {net or 'not in its log'}" if nccl is not None else "")
    data = {"gpu": gpus, "ib_ports": ib_ports, "nccl": nccl or {}}
    socket_fallback = multi_node and net == "Socket"
    if active and socket_fallback:
        fix = ["NCCL_IB_DISABLE=0 (unset it)" if (nccl or {}).get("ib_disabled") else "NCCL_IB_DISABLE=0",
               f"NCCL_IB_HCA={','.join(sorted({p['device'] for p in active}))}",
               "NCCL_SOCKET_IFNAME=<the interface on that fabric> (for the bootstrap)"]
        if roce:
            fix.append("NCCL_IB_GID_INDEX=3 (RoCE v2; `show_gids` lists the index of the IPv4 RoCE v2 GID)")
        return CheckResult("topology", node, False, observed, "NCCL over the IB/RoCE fabric",
                           "NCCL fell back to TCP sockets although this node has the fabric: set in [env] " + ", ".join(fix)
                           + "; check that the job can open /dev/infiniband/uverbs* (containers need it mounted)", data)
    return CheckResult("topology", node, True, observed, "", "", data)


# ---------------------------------------------------------------- the edges: reading this node, capturing NCCL's log

NCCL_LOG_NAME = "swiftslurm-nccl-{job}-{rank}.log"


def read_node(node: str, gpus_per_node: int, timeout_s: float, sysfs: str | Path = SYSFS_IB) -> CheckResult:
    """This node's readings as an (ok) ``topology`` result: ``nvidia-smi topo -m`` (bounded; only with GPUs)
    and the RDMA ports of ``sysfs``. ``combine`` judges it with NCCL's transport once the all-reduce ran."""
    import shutil

    from .. import bounded

    topo: dict[str, Any] = {"gpus": 0, "interconnect": "none"}
    if gpus_per_node > 0:
        topo = {}
        if shutil.which("nvidia-smi"):
            proc = bounded.run(["nvidia-smi", "topo", "-m"], timeout_s)
            topo = parse_topo_matrix(proc.stdout if not proc.timed_out and proc.returncode == 0 else "")
    return judge_transport(node, read_ib_ports(sysfs), None, False, topo)


def capture_nccl(env: MutableMapping[str, str], job_id: str, rank: int, multi_node: bool, tmpdir: str,
                 sysfs: str | Path = SYSFS_IB) -> Path | None:
    """Before the NCCL all-reduce: where NCCL's INFO lines will go, when it is worth asking (several nodes, an
    ACTIVE IB/RoCE port here, and NCCL_DEBUG not set by the user); sets NCCL_DEBUG=INFO,
    NCCL_DEBUG_SUBSYS=INIT,NET and NCCL_DEBUG_FILE in ``env`` (os.environ: NCCL reads them at its first init,
    once per process, so the trainer's own communicator init appends its few INIT/NET lines to the file too)."""
    if not multi_node or env.get("NCCL_DEBUG") or not any(p["state"] == "ACTIVE" for p in read_ib_ports(sysfs)):
        return None
    path = Path(tmpdir) / NCCL_LOG_NAME.format(job=job_id, rank=rank)
    env.update({"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": str(path)})
    return path


def read_nccl_log(path: Path | None) -> dict[str, Any] | None:
    """The transport NCCL logged to ``path`` (``capture_nccl``), or None when nothing was captured."""
    if path is None:
        return None
    try:  # a regular file only, its head (NCCL logs the transport at init): the path sits in a shared tmp dir
        with open_regular(path) as fh:
            head = fh.read(NCCL_LOG_CAP)
    except OSError:
        return None
    return parse_nccl_transport(head.decode("utf-8", "replace"))


def combine(results: list[CheckResult], nccl_by_rank: dict[int, Any], rank_nodes: list[str], multi_node: bool) -> list[CheckResult]:
    """Each node's ``topology`` reading judged with the transport NCCL chose on that node's ranks (pure)."""
    out = []
    for r in results:
        if r.check == "topology" and r.ok:
            seen = [nccl_by_rank[k] for k in sorted(nccl_by_rank) if k < len(rank_nodes) and rank_nodes[k] == r.node and nccl_by_rank[k]]
            nccl = next((v for v in seen if v.get("network")), seen[0] if seen else None)
            r = judge_transport(r.node, r.data.get("ib_ports", []), nccl, multi_node, r.data.get("gpu"))
        out.append(r)
    return out
