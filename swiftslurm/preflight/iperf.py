"""The ``iperf3`` check: a server per node on its own address, clients around a ring of nodes.

Node i runs ``iperf3 -s -B <its address> -p <port> -1`` (serve one client, then exit) and is the
client of node i+1 (a one-node job measures itself). Output is ``-J`` JSON; the received rate in
Gbit/s per pair is compared with ``min_iperf3_gbps``.
"""

from __future__ import annotations

import json
import subprocess
import time

from . import bounded
from .ports import resolve
from .results import CheckResult, missing_tool, which

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


def start_server(node: str, port: int) -> tuple[subprocess.Popen | None, CheckResult | None]:
    if which("iperf3") is None:
        return None, missing_tool("iperf3", node, "iperf3")
    addr, err = resolve(node)
    if addr is None:
        return None, CheckResult("iperf3", node, False, f"node name '{node}' does not resolve: {err}", "a resolvable node name", "fix /etc/hosts or DNS")
    proc = bounded.spawn(["iperf3", "-s", "-B", addr, "-p", str(port), "-1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, None


def stop_server(proc: subprocess.Popen | None) -> None:
    """Bounded: a server stuck in the kernel is left behind, not waited for."""
    if proc is not None:
        bounded.stop(proc)


def measure(src: str, dst: str, port: int, min_gbps: float) -> CheckResult:
    """``iperf3 -c dst`` from src's address; retries briefly while the server comes up."""
    pair = f"{src}->{dst}"
    expected = f">= {min_gbps:g} Gbit/s"
    if which("iperf3") is None:
        return missing_tool("iperf3", pair, "iperf3")
    src_addr, _ = resolve(src)
    argv = ["iperf3", "-c", dst, "-p", str(port), "-t", str(DURATION_S), "-J"] + (["-B", src_addr] if src_addr else [])
    limit = DURATION_S + CLIENT_GRACE_S
    deadline = time.monotonic() + CONNECT_RETRY_S
    while True:
        proc = bounded.run(argv, limit)
        gbps, err = (None, proc.describe_timeout("iperf3", limit)) if proc.timed_out else parse_iperf3_json(proc.stdout or proc.stderr)
        if gbps is not None or "connect" not in err or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if gbps is None:
        return CheckResult("iperf3", pair, False, f"no measurement: {err}", expected, f"is iperf3 running on {dst} and port {port} open between the nodes?")
    ok = gbps >= min_gbps
    hint = "" if ok else f"{src}->{dst} is slower than required: check the NIC/link of both nodes (`ethtool`, `ip -s link`), or lower preflight.min_iperf3_gbps"
    return CheckResult("iperf3", pair, ok, f"{gbps:.2f} Gbit/s", expected, hint, {"gbps": round(gbps, 3)})
