"""The ``iperf3`` check: a server per node on its own address, clients around a ring of nodes.

Node i runs ``iperf3 -s -B <its address> -p <port> -1`` (serve one client, then exit) and is the
client of node i+1 (a one-node job measures itself) with ``-P <iperf3_streams> -t <iperf3_duration_s>``.
"Its address" is the one on the interface NCCL will use (ifaces.py: NCCL_SOCKET_IFNAME). Output is ``-J``
JSON; the received rate in Gbit/s per pair is compared with ``min_iperf3_gbps`` (unset: a default floor
that only warns).
"""

from __future__ import annotations

import json
import subprocess
import time

from .. import bounded
from ..results import CheckResult, missing_tool, which
from .ports import resolve

DURATION_S = 3
STREAMS = 8
CONNECT_RETRY_S = 3.0
CLIENT_GRACE_S = 15  # on top of the duration: connect, the omitted warm-up, the JSON


def ring_target(node: str, nodes: list[str]) -> str:
    """The node this node measures against: the next one in allocation order (pure)."""
    i = nodes.index(node)
    return nodes[(i + 1) % len(nodes)]


def parse_iperf3_json(text: str) -> tuple[float | None, str]:
    """(Gbit/s received, error) from ``iperf3 -J`` output (pure)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None, f"not iperf3 JSON: {text.strip()[:120]!r}"
    if data.get("error"):
        return None, str(data["error"])
    end = data.get("end") or {}
    summary = end.get("sum_received") or end.get("sum") or {}
    bps = summary.get("bits_per_second")
    if bps is None:
        return None, "iperf3 JSON has no end.sum_received.bits_per_second"
    return bps / 1e9, ""


def local_address(node: str, env: dict[str, str]) -> tuple[str | None, str, CheckResult | None]:
    """(address, interface, failure) this node's iperf3 server and client use: on the interface NCCL will use."""
    from ..ifaces import IFNAME_ENV, interface_addresses, pick_address

    node_addr, err = resolve(node)
    addr, iface, why = pick_address(env, interface_addresses(), node_addr)
    if addr is None:
        hint = (f"set {IFNAME_ENV} (in [env]) to an interface every node has, e.g. the one `ip -4 addr` shows on the fast network"
                if env.get(IFNAME_ENV) else "fix /etc/hosts or DNS")
        return None, "", CheckResult("iperf3", node, False, f"{why or err} on {node}", "an address for the network NCCL uses", hint)
    return addr, iface, None


def start_server(node: str, port: int, addr: str) -> tuple[subprocess.Popen | None, CheckResult | None]:
    if which("iperf3") is None:
        return None, missing_tool("iperf3", node, "iperf3")
    proc = bounded.spawn(["iperf3", "-s", "-B", addr, "-p", str(port), "-1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, None


def stop_server(proc: subprocess.Popen | None) -> None:
    """Bounded: a server stuck in the kernel is left behind, not waited for."""
    if proc is not None:
        bounded.stop(proc)


def measure(src: str, dst: str, port: int, floor_gbps: float, binding: bool = True, streams: int = STREAMS, duration_s: int = DURATION_S,
            src_addr: str | None = None, dst_addr: str | None = None, iface: str = "") -> CheckResult:
    """``iperf3 -c <dst address> -P streams -t duration`` from src's address; retries briefly while the server comes up.
    A miss of a floor that is not ``binding`` (the default one) is a warning, not a failure."""
    pair = f"{src}->{dst}"
    expected = f">= {floor_gbps:g} Gbit/s" + ("" if binding else " (default floor: warns only)")
    if which("iperf3") is None:
        return missing_tool("iperf3", pair, "iperf3")
    src_addr = src_addr or resolve(src)[0]
    target = dst_addr or dst
    argv = ["iperf3", "-c", target, "-p", str(port), "-P", str(streams), "-t", str(duration_s), "-J"] + (["-B", src_addr] if src_addr else [])
    limit = duration_s + CLIENT_GRACE_S
    deadline = time.monotonic() + CONNECT_RETRY_S
    while True:
        proc = bounded.run(argv, limit)
        gbps, err = (None, proc.describe_timeout("iperf3", limit)) if proc.timed_out else parse_iperf3_json(proc.stdout or proc.stderr)
        if gbps is not None or "connect" not in err or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    route = f"{src_addr or src} -> {target}" + (f" over {iface}" if iface else "")
    if gbps is None:
        return CheckResult("iperf3", pair, False, f"no measurement ({route}): {err}", expected,
                           f"is iperf3 running on {dst} and port {port} open between the nodes?")
    ok = gbps >= floor_gbps
    hint = "" if ok else (f"{src}->{dst} is slower than expected: check the NIC/link of both nodes (`ethtool`, `ip -s link`) and that "
                          "NCCL_SOCKET_IFNAME names the fast network; " + ("or lower preflight.min_iperf3_gbps" if binding else
                                                                            "set preflight.min_iperf3_gbps to the rate this fabric should reach"))
    return CheckResult("iperf3", pair, ok, f"{gbps:.2f} Gbit/s ({route}, {streams} streams x {duration_s} s)", expected, hint,
                       {"gbps": round(gbps, 3), "streams": streams, "duration_s": duration_s, "interface": iface, "src": src_addr, "dst": target},
                       warn_only=not ok and not binding)
