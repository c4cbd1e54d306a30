"""The ``allreduce`` check: torch.distributed all-reduce across all ranks over a sweep of sizes.

NCCL on GPUs, gloo on CPUs. Bandwidth follows the nccl-tests convention: algbw = bytes / time,
busbw = algbw x 2(n-1)/n, in GB/s (1e9 bytes/s). The collective runs in a worker thread bounded by a
watchdog (``join(timeout)``) on top of ``init_process_group(timeout=...)``: a dead or hung rank
makes this rank report a failure in bounded time, never hang.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from datetime import timedelta
from typing import Any

CPU_SIZES = [2**k for k in (12, 16, 20, 22, 24)]  # 4 KiB .. 16 MiB
GPU_SIZES = [2**k for k in (20, 22, 24, 26, 28, 30, 32)]  # 1 MiB .. 4 GiB


def bus_bw(algbw: float, world_size: int) -> float:
    """nccl-tests all-reduce bus bandwidth (pure)."""
    return algbw * 2 * (world_size - 1) / world_size if world_size > 0 else 0.0


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}"
        n /= 1024
    return f"{n:g} GiB"


def short_error(exc: BaseException) -> str:
    """The first line of a torch/gloo/NCCL error without its source-file prefix (pure)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", text)
    return f"{type(exc).__name__}: {text[:160]}"


def iterations(size: int, backend: str) -> int:
    """Timed iterations per size: the same on every rank (collective counts must match)."""
    if backend == "nccl":
        return 20 if size <= 2**26 else 5
    return 10 if size <= 2**20 else 3


class Abandoned(Exception):
    """The watchdog gave up on this sweep: stop before touching the process group again."""


def _sweep(rank: int, world_size: int, backend: str, store: Any, timeout_s: float, local_rank: int, fault: str, on_progress: Any,
           abandoned: threading.Event) -> dict[str, Any]:
    import torch
    import torch.distributed as tdist

    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    tdist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
    if abandoned.is_set():  # init finished after the watchdog released the group: leave none behind
        tdist.destroy_process_group()
        raise Abandoned()
    group = tdist.group.WORLD
    sizes = GPU_SIZES if backend == "nccl" else CPU_SIZES
    out: dict[str, Any] = {"sizes": [], "algbw_gbps": [], "busbw_gbps": [], "backend": backend}

    def sync() -> None:
        if backend == "nccl":
            torch.cuda.synchronize()

    for k, size in enumerate(sizes):
        if fault == "kill" and k == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # test hook: a rank dies mid-sweep
        if fault == "hang" and k == 1:
            time.sleep(10**6)  # test hook: a rank hangs mid-sweep
        if abandoned.is_set():  # the watchdog gave up on this sweep: no more collectives on the released group
            raise Abandoned()
        on_progress(k)  # "entered size k": a rank that stalls before a collective is the one the others wait for
        x = torch.ones(size // 4, dtype=torch.float32, device=device)
        tdist.all_reduce(x, group=group)  # warm-up
        sync()
        n = iterations(size, backend)
        t0 = time.perf_counter()
        for _ in range(n):
            tdist.all_reduce(x, group=group)
        sync()
        dt = (time.perf_counter() - t0) / n
        algbw = size / dt / 1e9
        out["sizes"].append(size)
        out["algbw_gbps"].append(round(algbw, 4))
        out["busbw_gbps"].append(round(bus_bw(algbw, world_size), 4))
    return out


def run_allreduce(rank: int, world_size: int, backend: str, store: Any, timeout_s: float, local_rank: int = 0, fault: str = "",
                  on_progress: Any = lambda k: None) -> dict[str, Any]:
    """This rank's view of the sweep: ``{"ok", "error", "sizes", "algbw_gbps", "busbw_gbps", "wall_s", "released"}``.

    The preflight's process group is released afterwards whatever happened (finished, failed, or given up
    on by the watchdog with a collective still hung in it), so the trainer inits a fresh one instead of
    reusing a poisoned group; ``released`` says whether that worked.
    """
    box: dict[str, Any] = {}
    abandoned = threading.Event()
    t0 = time.monotonic()

    def work() -> None:
        try:
            box["result"] = _sweep(rank, world_size, backend, store, timeout_s, local_rank, fault, on_progress, abandoned)
        except Abandoned:
            pass
        except Exception as exc:  # gloo: "Connection closed by peer", timeouts, NCCL errors
            box["error"] = short_error(exc)

    thread = threading.Thread(target=work, name="preflight-allreduce", daemon=True)
    thread.start()
    thread.join(timeout=timeout_s + 5)  # the watchdog
    wall = round(time.monotonic() - t0, 2)
    if thread.is_alive():
        abandoned.set()
        view = {"ok": False, "error": f"all-reduce did not finish within {timeout_s:.0f} s (a peer is dead or hung)", "wall_s": wall}
    elif "error" in box:
        view = {"ok": False, "error": box["error"], "wall_s": wall}
    else:
        view = {"ok": True, "error": "", "wall_s": wall, **box["result"]}
    view["released"] = release_process_group()
    return view


RELEASE_WAIT_S = 10.0


def release_process_group(wait_s: float = RELEASE_WAIT_S) -> bool:
    """Destroy this process's default process group (NCCL communicators aborted first), bounded: True when
    none is left. A collective still hung in it then fails, instead of the trainer inheriting the group."""
    try:
        import torch.distributed as tdist
    except ImportError:
        return True
    if not (tdist.is_available() and tdist.is_initialized()):
        return True

    def destroy() -> None:
        try:
            if tdist.get_backend() == "nccl":
                from torch.distributed import distributed_c10d

                abort = getattr(distributed_c10d, "_abort_process_group", None)
                if abort is not None:
                    abort()
        except Exception:
            pass
        try:
            if tdist.is_initialized():
                tdist.destroy_process_group()
        except Exception:
            pass

    worker = threading.Thread(target=destroy, name="preflight-release-group", daemon=True)
    worker.start()
    worker.join(timeout=wait_s)
    return not tdist.is_initialized()


def judge(per_rank: dict[int, dict[str, Any]], missing: list[int], rank_nodes: list[str], min_busbw_gbps: float, timeout_s: float,
          progress: dict[Any, int] | None = None) -> list:
    """Results from every rank's view of the sweep (pure).

    A rank that never reported is named with its node (that is where the fault is); the errors the
    others saw then follow from it and are folded into one result about ``all``.
    """
    from ..results import CheckResult

    results = []
    expected = f"busbw >= {min_busbw_gbps:g} GB/s" if min_busbw_gbps > 0 else "all ranks complete (busbw reported only)"
    for r in sorted(missing):
        node = rank_nodes[r] if r < len(rank_nodes) else "?"
        results.append(CheckResult(
            "allreduce", node, False, f"rank {r} on {node} died or hung: no result from it while the other ranks finished", expected,
            f"see rank {r}'s log on {node}; a dead rank in the preflight would have hung NCCL for the whole run: drain or exclude {node}",
        ))
    errors = {r: v["error"] for r, v in per_rank.items() if not v.get("ok")}
    progress = {int(r): int(k) for r, k in (progress or {}).items()}
    if errors and not missing and progress and len(set(progress.values())) > 1:
        # everyone failed, but some ranks never entered the collective the others were waiting in
        last = min(progress.values())
        stalled = sorted(r for r, k in progress.items() if k == last)
        reached = max(progress.values())
        for r in stalled:
            node = rank_nodes[r] if r < len(rank_nodes) else "?"
            results.append(CheckResult(
                "allreduce", node, False, f"rank {r} on {node} stalled at size #{last} while the others reached #{reached} (hung)", expected,
                f"rank {r} hung: see its log on {node}; drain or exclude {node}",
            ))
        missing = stalled  # the other ranks' errors follow from the stalled ones
    if errors or missing:
        others = {r: e for r, e in errors.items() if r not in missing}
        if missing and others:
            first = next(iter(sorted(others.items())))
            results.append(CheckResult("allreduce", "all", False, f"{len(others)} other rank(s) failed as a consequence, e.g. rank {first[0]}: {first[1]}",
                                       expected, "fix the rank(s) named above"))
        elif not missing:
            for r, err in sorted(errors.items()):
                node = rank_nodes[r] if r < len(rank_nodes) else "?"
                results.append(CheckResult("allreduce", node, False, f"rank {r}: {err}", expected,
                                           "check NCCL_DEBUG=INFO output and the network between the nodes (NCCL_SOCKET_IFNAME, NCCL_IB_HCA)"))
    if missing or errors:
        return results
    view = per_rank[0] if 0 in per_rank else next(iter(per_rank.values()))
    sizes, busbw, algbw = view.get("sizes", []), view.get("busbw_gbps", []), view.get("algbw_gbps", [])
    if not sizes:
        return [CheckResult("allreduce", "all", False, "no sizes measured", expected, "")]
    peak = max(range(len(sizes)), key=lambda i: busbw[i])
    n = len(rank_nodes)
    ok = min_busbw_gbps <= 0 or busbw[peak] >= min_busbw_gbps
    observed = f"peak busbw {busbw[peak]:.2f} GB/s (algbw {algbw[peak]:.2f}) at {human_bytes(sizes[peak])}; {n} ranks, {view.get('backend')}"
    hint = "" if ok else ("the collective is slower than required: check NCCL_DEBUG=INFO for the transport used (IB/RoCE vs sockets), "
                          "NCCL_IB_HCA, NCCL_SOCKET_IFNAME")
    data = {"sizes": sizes, "algbw_gbps": algbw, "busbw_gbps": busbw, "backend": view.get("backend"), "world_size": n}
    return [CheckResult("allreduce", "all", ok, observed, expected, hint, data)]


def unreleased(per_rank: dict[int, dict[str, Any]], rank_nodes: list[str]) -> list:
    """A failed ``process-group`` result for each rank that could not release the preflight's group (pure).
    Fatal whatever on_failure says (results.FATAL_CHECKS): training there would inherit a hung collective."""
    from ..results import CheckResult

    out = []
    for r, view in sorted(per_rank.items()):
        if view.get("released") is False:
            node = rank_nodes[r] if r < len(rank_nodes) else "?"
            out.append(CheckResult(
                "process-group", node, False, f"rank {r} on {node} could not destroy the preflight's process group (a collective is hung in it)",
                "released before training", f"the trainer would inherit the hung group: resubmit; if it recurs, drain {node} (GPU or NIC fault?)",
            ))
    return out
