"""Running the checks on every rank of a job and gathering their results on rank 0.

One process per Slurm task calls ``run_checks``. Node-level checks (ports, iperf3, nvme, gpu, disk,
sharedfs) run on local rank 0 of each node, in parallel threads; the all-reduce runs on every rank.
Phases are separated by store barriers with deadlines:

  connect -> [ready] -> network + local checks -> [network-done] -> post node results
  -> all-reduce sweep -> post rank result -> rank 0 gathers (missing ranks are named)
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ..fsutil import atomic_write_text
from . import bounded
from .checks import allreduce, iperf, local, ports, topology
from .coord import CoordinationError, Coordinator, preflight_ports
from .results import CheckResult

if TYPE_CHECKING:
    from ..slurm.distenv import DistEnv
    from ..spec.model import JobSpec

FAULT_ENV = "SWIFTSLURM_PREFLIGHT_FAULT"
FAULT_KINDS = ("no-listener", "kill-allreduce", "hang-allreduce")
GATHER_GRACE_S = 8


def parse_faults(text: str) -> set[tuple[str, str]]:
    """Test hook ``SWIFTSLURM_PREFLIGHT_FAULT="no-listener@node2,kill-allreduce@rank1"`` (pure)."""
    out = set()
    for item in (text or "").split(","):
        kind, _, where = item.strip().partition("@")
        if kind in FAULT_KINDS and where:
            out.add((kind, where))
    return out


@dataclass
class Outcome:
    """What one rank ends with: the coordinator (for the decision broadcast) and, on rank 0, all results."""

    coord: Coordinator | None
    results: list[CheckResult]
    meta: dict[str, Any]


def node_checks_s(timeout_s: float) -> float:
    """How long the node checks may take, from the "ready" barrier (pure): each tool is killed after
    ``timeout_s``, then bounded.stop's grace; a check function still running after that is reported as hung."""
    return timeout_s + bounded.TERM_GRACE_S + bounded.KILL_WAIT_S + 1


def node_checks_budget(pf: Any, checks: list[str]) -> float:
    """The node checks' bound for a [preflight] table: the iperf3 run itself is on top of timeout_s (pure)."""
    return node_checks_s(float(pf.timeout_s)) + (pf.iperf3_duration_s + iperf.CLIENT_GRACE_S if "iperf3" in checks else 0)


def _start_local_checks(calls: bounded.Calls, checks: list[str], node: str, spec: JobSpec, output_dir: str, ds_config: dict | None,
                        env: Mapping[str, str]) -> None:
    pf = spec.preflight
    tool_s = float(pf.timeout_s)
    if "nvme" in checks:
        path = pf.nvme_path or local.nvme_target(ds_config, output_dir)[0]
        floor, binding = pf.nvme_floor
        calls.start("nvme", node, lambda: local.check_nvme(node, path, floor, tool_s, binding))
    if "gpu" in checks:
        calls.start("gpu", node, lambda: local.check_gpu(node, spec.slurm.gpus_per_node, tool_s, dict(env)))
    if "disk" in checks:
        calls.start("disk", node, lambda: local.check_disk(node, output_dir, pf.min_disk_free_gb))
    if "allreduce" in checks:  # the GPU interconnect and IB/RoCE ports, judged with NCCL's transport in _gather
        calls.start("topology", node, lambda: [topology.read_node(node, spec.slurm.gpus_per_node, tool_s)])


def run_checks(dist: DistEnv, spec: JobSpec, output_dir: str, checks: list[str], env: dict[str, str] | None = None,
               ds_config: dict | None = None) -> Outcome:
    environ: Mapping[str, str] = os.environ if env is None else env
    faults = parse_faults(environ.get(FAULT_ENV, ""))
    pf = spec.preflight
    timeout_s = float(pf.timeout_s)
    nodes = list(dist.nodes)
    node, rank, world = dist.node, dist.rank, dist.world_size
    leader = dist.local_rank == 0
    port = preflight_ports(dist.master_port)
    phases: dict[str, float] = {}
    meta: dict[str, Any] = {"nodes": nodes, "world_size": world, "checks": checks, "ports": port, "phase_s": phases}
    t_phase = time.monotonic()

    def phase(name: str) -> None:  # rank 0's time per phase, in the report: where a slow preflight spent it
        nonlocal t_phase
        phases[name] = round(time.monotonic() - t_phase, 2)
        t_phase = time.monotonic()


    try:
        coord = Coordinator.connect(dist.master_addr, port["coord"], rank, world, timeout_s, prefix=f"preflight-{dist.job_id}")
    except CoordinationError as exc:
        taken = ports.bind_error(port["coord"]) if rank == 0 else None  # this job's port, held by another process
        hint = (f"port {port['coord']} is taken on {node} ({taken}), not this job's: resubmit (a new job id derives other "
                "ports) or set MASTER_PORT in [env] to a free port") if taken else "is MASTER_ADDR reachable from this node? is the port free?"
        return Outcome(None, [CheckResult("coordination", node, False, str(exc), "all ranks join", hint,
                                          data={"port_taken": port["coord"]} if taken else {})], meta)
    coord.put(f"rank-node/{rank}", node)

    sharedfs_file = Path(output_dir) / "preflight" / f".sharedfs-{dist.job_id}"
    if rank == 0 and "sharedfs" in checks:
        nonce = secrets.token_hex(8)
        sharedfs_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(sharedfs_file, nonce)  # never through a link someone left under the name
        coord.put("sharedfs/nonce", nonce)

    mine: list[CheckResult] = []
    listener = server = addr = None
    iface = ""
    calls = bounded.Calls()  # daemon threads: a check stuck in the kernel is reported, never waited for
    if leader:
        if "ports" in checks and ("no-listener", node) not in faults:
            listener, bad = ports.open_listener(node, port["test"])
            mine += [bad] if bad else []
        if "iperf3" in checks:
            addr, iface, bad = iperf.local_address(node, dict(environ))
            if addr is not None:
                coord.put(f"iperf-addr/{node}", [addr, iface])  # before "ready": the client of this node reads it
                server, bad = iperf.start_server(node, port["iperf3"], addr)
            mine += [bad] if bad else []
        _start_local_checks(calls, checks, node, spec, output_dir, ds_config, environ)
    if rank == 0 and "ports" in checks:  # the rank that will host the rendezvous on MASTER_PORT
        mine.append(ports.check_master_port(node, dist.master_port, ports.ephemeral_range()))

    missing_ready = coord.barrier("ready", time.monotonic() + timeout_s)
    phase("connect")
    checks_done = time.monotonic() + node_checks_budget(pf, checks)  # the same bound on every node
    try:
        if leader:
            if "ports" in checks:
                calls.start("ports", node, lambda: ports.check_ports(node, nodes, port["test"], nodes[0]))
            if "iperf3" in checks and addr is not None:
                target = iperf.ring_target(node, nodes)
                dst = coord.get(f"iperf-addr/{target}", time.monotonic() + 1.0) or [None, ""]
                floor, binding = pf.iperf3_floor
                calls.start("iperf3", f"{node}->{target}", lambda: [iperf.measure(
                    node, target, port["iperf3"], floor, binding, pf.iperf3_streams, pf.iperf3_duration_s, addr, dst[0], iface)])
            if "sharedfs" in checks:
                published = coord.get("sharedfs/nonce", time.monotonic() + timeout_s)
                if published:
                    calls.start("sharedfs", node, lambda: local.read_nonce(node, sharedfs_file, published))
                else:
                    mine.append(CheckResult("sharedfs", node, False, "rank 0 never published the nonce", "", "see rank 0's log"))
            mine += calls.collect(checks_done)
        # everyone waits for the slowest node's bounded checks, then a timeout more for a rank that is late
        coord.barrier("network-done", checks_done + timeout_s)
        phase("node_checks")
    finally:
        if listener:
            listener.close()
        iperf.stop_server(server)
    if leader:
        coord.put(f"node-results/{node}", [r.to_json() for r in mine])

    if "allreduce" in checks:
        backend = "nccl" if spec.slurm.gpus_per_node > 0 and _cuda() else "gloo"
        fault = "kill" if ("kill-allreduce", f"rank{rank}") in faults else "hang" if ("hang-allreduce", f"rank{rank}") in faults else ""
        nccl_log = topology.capture_nccl(os.environ, dist.job_id, rank, len(nodes) > 1, tempfile.gettempdir()) if backend == "nccl" else None
        view = allreduce.run_allreduce(rank, world, backend, _prefixed(coord, "allreduce"), timeout_s, dist.local_rank, fault,
                                       on_progress=lambda k: coord.put(f"ar-progress/{rank}", k))
        view["nccl"] = topology.read_nccl_log(nccl_log)
        coord.put(f"allreduce/{rank}", view)
        phase("allreduce")

    if rank != 0:
        return Outcome(coord, [], meta)
    results = _gather(coord, checks, nodes, world, missing_ready, timeout_s, sharedfs_file, pf.min_allreduce_busbw_gbps)
    phase("gather")
    return Outcome(coord, results, meta)


def _gather(coord: Coordinator, checks: list[str], nodes: list[str], world: int, missing_ready: list[int],
            timeout_s: float, sharedfs_file: Path, min_busbw: float) -> list[CheckResult]:
    deadline = time.monotonic() + GATHER_GRACE_S
    rank_nodes_found, _ = coord.gather("rank-node", list(range(world)), time.monotonic())
    rank_nodes = [rank_nodes_found.get(r, "?") for r in range(world)]
    by_node, missing_nodes = coord.gather("node-results", nodes, deadline)
    results: list[CheckResult] = []
    for n in nodes:
        results += [CheckResult.from_json(d) for d in by_node.get(n, [])]
    for n in missing_nodes:
        results.append(CheckResult("preflight", n, False, f"{n} did not report its node checks within the timeout", "every node reports",
                                   f"the preflight process on {n} died or hung: see its log"))
    if "allreduce" in checks:
        views, missing = coord.gather("allreduce", list(range(world)), deadline)
        progress, _ = coord.gather("ar-progress", list(range(world)), time.monotonic())
        results = topology.combine(results, {int(k): v.get("nccl") for k, v in views.items()}, rank_nodes, len(nodes) > 1)
        results += allreduce.judge({int(k): v for k, v in views.items()}, missing, rank_nodes, min_busbw, timeout_s, progress)
        results += allreduce.unreleased({int(k): v for k, v in views.items()}, rank_nodes)
    try:
        sharedfs_file.unlink()
    except OSError:
        pass
    return results


def _prefixed(coord: Coordinator, prefix: str) -> Any:
    import torch.distributed as tdist

    return tdist.PrefixStore(prefix, coord.store)


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False
