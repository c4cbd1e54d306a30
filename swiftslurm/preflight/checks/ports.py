"""The ``ports`` check: every node reaches every other node's test port with ``nc -z``.

Each node binds a listener on its own address (the address its name resolves to) on a test port
derived from MASTER_PORT; the master node's listener sits on MASTER_ADDR, so reaching it proves
MASTER_ADDR is reachable without touching MASTER_PORT, which the trainer binds later.
"""

from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor

from .. import bounded
from ..results import CheckResult, missing_tool, which

NC_WAIT_S = 2


def resolve(node: str) -> tuple[str | None, str]:
    """(address, error) for a node name."""
    try:
        return socket.gethostbyname(node), ""
    except OSError as exc:
        return None, str(exc)


class Listener:
    """A TCP listener on (addr, port) that accepts and closes connections until stopped."""

    def __init__(self, addr: str, port: int) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((addr, port))
        self.sock.listen(128)
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
                conn.close()
            except (socket.timeout, OSError):
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)
        self.sock.close()


def open_listener(node: str, port: int) -> tuple[Listener | None, CheckResult | None]:
    """Bind this node's test listener; a failure is a result naming the node, not an exception."""
    addr, err = resolve(node)
    if addr is None:
        return None, CheckResult("ports", node, False, f"node name '{node}' does not resolve: {err}", "a resolvable node name",
                                 "fix /etc/hosts or DNS on this node")
    try:
        return Listener(addr, port), None
    except OSError as exc:
        return None, CheckResult(
            "ports", node, False, f"cannot bind test listener {addr}:{port}: {exc.strerror}", f"{addr}:{port} free",
            "another process holds the port; the preflight uses MASTER_PORT+1..+3, so pick another MASTER_PORT",
        )


EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int] | None:
    """This node's ephemeral port range (Linux), or None where it cannot be read."""
    from ...slurm.distenv import parse_port_range

    try:
        with open(path) as fh:
            return parse_port_range(fh.read())
    except OSError:
        return None


def bind_error(port: int) -> str | None:
    """Why ``port`` cannot be bound on every address of this node, or None when it is free.

    Binds the way torch's TCPStore binds MASTER_PORT (all addresses, SO_REUSEADDR: a TIME_WAIT left by
    the previous run of a requeued job does not count), then lets go at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def check_master_port(node: str, port: int, ephemeral: tuple[int, int] | None = None) -> CheckResult:
    """Rank 0's node, before the rendezvous: MASTER_PORT must be free there; in the ephemeral range it
    may be taken at any moment by an outgoing connection, which the result says even when it is free."""
    in_range = ephemeral is not None and ephemeral[0] <= port <= ephemeral[1]
    where = f" (inside this node's ephemeral range {ephemeral[0]}-{ephemeral[1]}, where outgoing connections take ports)" \
        if in_range and ephemeral is not None else ""
    fix = ("set MASTER_PORT in [env] to a free port outside the ephemeral range (net.ipv4.ip_local_port_range), "
           "or resubmit: a new job id derives another port")
    error = bind_error(port)
    if error:
        return CheckResult("ports", node, False, f"MASTER_PORT {port} is busy on {node}: {error}{where}", f"MASTER_PORT {port} free", fix,
                           data={"port_taken": port})
    return CheckResult("ports", node, True, f"MASTER_PORT {port} free{where}", f"MASTER_PORT {port} free", fix if in_range else "")


def probe(src: str, dst: str, port: int, is_master: bool = False) -> CheckResult:
    """``nc -z -w 2 dst port`` from this node."""
    pair = f"{src}->{dst}"
    target = f"{dst}:{port}" + (" (MASTER_ADDR)" if is_master else "")
    proc = bounded.run(["nc", "-z", "-w", str(NC_WAIT_S), dst, str(port)], NC_WAIT_S + 3)
    ok, detail = proc.returncode == 0, "nc timed out" if proc.timed_out else (proc.stderr or proc.stdout).strip()
    if ok:
        return CheckResult("ports", pair, True, f"{target} reachable", "reachable")
    return CheckResult(
        "ports", pair, False, f"{target} unreachable" + (f" ({detail[:120]})" if detail else ""), "reachable",
        f"{dst} is not listening or a firewall blocks {port}: check `nc -l {port}` on {dst} and the firewall between the nodes",
    )


def check_ports(node: str, nodes: list[str], port: int, master_node: str) -> list[CheckResult]:
    """Probe every other node's test port (itself too, on a one-node job), in parallel."""
    if which("nc") is None:
        return [missing_tool("ports", node, "nc")]
    targets = [n for n in nodes if n != node] or [node]
    with ThreadPoolExecutor(max_workers=min(16, len(targets))) as pool:
        return list(pool.map(lambda dst: probe(node, dst, port, dst == master_node), targets))
