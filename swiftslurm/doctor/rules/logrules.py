"""Findings recognised from log text: CUDA and host OOM, device mismatch, checkpoint keys, communication
timeouts, ranks killed by a signal or lost with their node (pure over a ``TaskRun``)."""

from __future__ import annotations

import re
from typing import Iterable

from ...train.health.startup import STUCK
from ...watch.logs import TORCH_PREFIX
from ..evidence import Line, TaskRun
from ..findings import Evidence, Finding

CUDA_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|CUBLAS_STATUS_ALLOC_FAILED|"
                      r"cudaErrorMemoryAllocation|HIP out of memory|NCCL WARN .*Cuda failure 'out of memory'")
HOST_OOM = re.compile(r"oom-kill event|oom_kill|Out of memory: Killed process|killed by the cgroup out-of-memory handler")
DEVICE_MISMATCH = re.compile(r"Expected all tensors to be on the same device")
CKPT_KEYS = re.compile(
    r"Missing key\(s\) in state_dict|Unexpected key\(s\) in state_dict|Error\(s\) in loading state_dict|"
    r"size mismatch for \S+: copying a param|There were (missing|unexpected) keys in the checkpoint model loaded|"
    r"Found missing adapter keys|missing_keys=\[['\"]"
)
# communication failures: timeouts (a rank waited for others) and peers gone (a rank's partner died or left)
COMM_TIMEOUT = re.compile(
    r"Watchdog caught collective operation timeout|collective operation timeout|Timed out waiting \d+ ?ms for \w+ operation|"
    r"Timed out after \d+ seconds waiting for clients|wait timeout after \d+|Socket Timeout|DistStoreError.*[Tt]imed? ?out|"
    r"NCCL (communicator|comm) .*(timeout|timed out)|ProcessGroupNCCL.*[Tt]imeout|failed to pass monitoredBarrier|"
    r"\[gloo\].*[Tt]imed out|\bNCCL timeout\b"
)
COMM_PEER = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe.*gloo|gloo.*Broken pipe|ncclRemoteError|"
    r"ncclSystemError|ncclInternalError|NCCL error in:|DistNetworkError|DistBackendError|"
    r"NCCL communicator was aborted|Failed to recv, got 0 bytes|connect\(\) timed out|Connection refused.*(store|rendezvous|MASTER)"
)
# a rank ended by a signal, or a node lost (srun's, slurmstepd's and the runtime's words)
NODE_LOST = re.compile(r"DUE TO NODE FAIL|Node failure on (\S+)|NODE_FAIL|node (\S+) not responding", re.I)
# "Terminated" is not here: a SIGTERM comes from Slurm itself (the time limit, a requeue, scancel, preemption), never
# from a node's fault, and a walltime requeue loop must not blame its healthy nodes
SRUN_TASK = re.compile(r"srun: error: (?P<node>[^\s:]+): tasks? (?P<rank>\d+)(?:-\d+)?: (?P<how>Killed|Segmentation fault|Aborted|Bus error)")
STARTUP_STUCK = re.compile(r"not training: " + re.escape(STUCK))  # the rank's own record line (node/runtime.py)
COMMAND_EXIT = re.compile(r"train\.command exited with (-?\d+)")
KILLED_BY = re.compile(r"Fatal Python error: (Segmentation fault|Bus error|Aborted)|died with <Signals\.(SIG\w+)|exitcode\s*:\s*-(\d+)")
FATAL_SIGNALS = {6: "SIGABRT", 7: "SIGBUS", 9: "SIGKILL", 11: "SIGSEGV"}  # a rank killed by one of these did not end on its own


def bare(text: str) -> str:
    return TORCH_PREFIX.sub("", text)


def hits(run: TaskRun, pattern: re.Pattern) -> list[Line]:
    return [ln for ln in run.all_lines if pattern.search(bare(ln.text))]


def evidence_of(run: TaskRun, lines: Iterable[Line], limit: int = 4) -> tuple[Evidence, ...]:
    """The first line of each rank, earliest first (at most ``limit``)."""
    first: dict[int, Line] = {}
    for ln in sorted(lines, key=lambda x: x.time):
        first.setdefault(ln.rank, ln)
    return tuple(Evidence(ln.file, ln.number, ln.rank, ln.node, run.step_at(ln.time), bare(ln.text).strip()[:400])
                 for ln in sorted(first.values(), key=lambda x: (x.time, x.rank))[:limit])


def finding(run: TaskRun, code: str, lines: list[Line], what: str, cause: str, fix: str, keys: tuple[str, ...]) -> Finding:
    ranks = tuple(sorted({ln.rank for ln in lines}))
    nodes = tuple(sorted({ln.node for ln in lines if ln.node}))
    return Finding(code, what, cause, fix, keys, evidence_of(run, lines), run.task, ranks, nodes)


def _ranks_text(lines: list[Line]) -> str:
    ranks = sorted({ln.rank for ln in lines})
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks[:8]))}{' ...' if len(ranks) > 8 else ''}"


# ---------------------------------------------------------------- what the spec has on (for the fix texts)


def offload_of(run: TaskRun) -> list[str]:
    """What the task offloads: 'optimizer'/'param' with their device ('cpu'/'nvme'), from the preset name and [deepspeed]."""
    preset = str(run.train("deepspeed", "") or "")
    zero = ((run.spec.get("deepspeed") or {}).get("zero_optimization") or {})
    found = []
    for part in ("optimizer", "param"):
        device = str((zero.get(f"offload_{part}") or {}).get("device", "") or "")
        if not device and "nvme" in preset:
            device = "nvme"
        elif not device and "offload" in preset and (part == "optimizer" or preset.startswith("zero3")):
            device = "cpu"
        if device and device != "none":
            found.append(f"{part} on {device}")
    return found


# ---------------------------------------------------------------- rules


def cuda_oom(run: TaskRun) -> list[Finding]:
    lines = hits(run, CUDA_OOM)
    if not lines:
        return []
    micro = run.train("per_device_train_batch_size")
    preset = str(run.train("deepspeed", "") or "")
    steps = [f"lower train.per_device_train_batch_size{f' (now {micro})' if micro else ''} and raise "
             "train.gradient_accumulation_steps to keep the global batch"]
    keys = ["train.per_device_train_batch_size", "train.gradient_accumulation_steps"]
    if not preset.startswith("zero3"):
        steps.append("shard the model: train.deepspeed = \"zero3\"")
        keys.append("train.deepspeed")
    if "offload" not in preset and "nvme" not in preset:
        steps.append("offload to CPU memory: train.deepspeed = \"zero3_offload\"")
        keys.append("train.deepspeed")
    if run.train("gradient_checkpointing") is False:
        steps.append("train.gradient_checkpointing = true")
        keys.append("train.gradient_checkpointing")
    length = run.train("max_length")
    if length:
        steps.append(f"shorter sequences: train.max_length (now {length})")
        keys.append("train.max_length")
    return [finding(run, "cuda_oom", lines, f"GPU memory ran out on {_ranks_text(lines)}",
                    "the model, optimizer state and activations of one micro-batch do not fit the GPU",
                    "; or ".join(steps), tuple(dict.fromkeys(keys)))]


def host_oom(run: TaskRun) -> list[Finding]:
    lines = hits(run, HOST_OOM)
    if not lines and run.state != "OUT_OF_MEMORY":
        return []
    what = "the kernel's OOM killer ended a rank (host memory)" + (f" on {_ranks_text(lines)}" if lines else f": Slurm state {run.state}")
    return [finding(run, "host_oom", lines, what,
                    "the ranks of a node used more host memory than the job may (CPU offload, data loading, pinned buffers)",
                    "ask for more memory (slurm.mem, \"0\" = the whole node), or offload less (train.deepspeed without "
                    "\"_offload\"), or fewer ranks per node (slurm.tasks_per_node)",
                    ("slurm.mem", "train.deepspeed", "slurm.tasks_per_node"))]


def device_mismatch(run: TaskRun) -> list[Finding]:
    lines = hits(run, DEVICE_MISMATCH)
    if not lines:
        return []
    offload = offload_of(run)
    cause = ("with offload on (" + ", ".join(offload) + "), a tensor the step needs stayed on the GPU while its partner was "
             "offloaded (a known DeepSpeed combination problem)") if offload else \
        "two tensors of one operation live on different devices (a model or custom code placing tensors by hand, or offload set in the DeepSpeed JSON)"
    return [finding(run, "device_mismatch", lines, f"tensors on different devices on {_ranks_text(lines)}", cause,
                    "offload the optimizer and the parameters both to the CPU (train.deepspeed = \"zero3_offload\", or both "
                    "deepspeed.zero_optimization.offload_optimizer.device and offload_param.device = \"cpu\"); drop NVMe offload",
                    ("train.deepspeed", "deepspeed.zero_optimization.offload_optimizer.device",
                     "deepspeed.zero_optimization.offload_param.device"))]


def ckpt_missing_keys(run: TaskRun) -> list[Finding]:
    lines = hits(run, CKPT_KEYS)
    if not lines:
        return []
    return [finding(run, "ckpt_missing_keys", lines, f"a checkpoint did not match the model on load ({_ranks_text(lines)})",
                    "the checkpoint was written for another model, train_type or LoRA layout (lora_rank, lora_target_modules) "
                    "than the spec builds now, or by another tool",
                    "resume with the spec that wrote it (train.model, train.train_type, train.lora_*), or start from its weights "
                    "only (train.resume_from with train.resume_weights_only = true); a checkpoint another tool wrote goes "
                    "through `swiftslurm import PATH --into DIR`",
                    ("train.resume_from", "train.resume_weights_only", "train.model", "train.train_type", "train.lora_rank"))]


def comm_lines(run: TaskRun) -> tuple[list[Line], list[Line]]:
    """(timeout lines, peer-gone lines)."""
    return hits(run, COMM_TIMEOUT), [ln for ln in hits(run, COMM_PEER) if not COMM_TIMEOUT.search(bare(ln.text))]


def startup_hang(run: TaskRun) -> list[Finding]:
    """A rank ended by the start-up watch: its line names the phase it was stuck in (a build lock, a load)."""
    lines = hits(run, STARTUP_STUCK)
    if not lines:
        return []
    said = bare(lines[0].text).split("not training: ", 1)[-1]
    lock = "build lock" in said
    return [finding(run, "startup_hang", lines, f"{_ranks_text(lines)} never started training: {said}",
                    "a build lock left by a rank killed while it built a DeepSpeed op (torch waits on such a lock "
                    "forever)" if lock else "the start (imports, op builds, model load, deepspeed.initialize) waited "
                    "on something that never came: the stacks dumped in the same log show what",
                    "delete the lock file named if no build is running, then resubmit" if lock else
                    "see the stacks in the rank's log; raise train.ddp_timeout if the start is only slow",
                    () if lock else ("train.ddp_timeout",))]


def nccl_timeout(run: TaskRun) -> list[Finding]:
    timeouts, peers = comm_lines(run)
    lines = timeouts + peers
    if not lines:
        return []
    kind = "timed out" if timeouts else "lost their peers"
    return [finding(run, "nccl_timeout", lines, f"collectives {kind} on {_ranks_text(lines)}",
                    "a rank did not join a collective in time (a hang or a dead rank: see the findings above), or the "
                    "nodes cannot reach each other on MASTER_PORT and the NCCL/gloo ports, or InfiniBand is down",
                    "open MASTER_PORT (the banner's `master`) and the port range between the nodes; check InfiniBand with "
                    "`ibstat` (or set env.NCCL_IB_DISABLE = \"1\" to test over TCP, env.NCCL_SOCKET_IFNAME to pick the "
                    "interface); keep \"ports\" in preflight.checks so the preflight tests them first",
                    ("preflight.checks", "env.NCCL_IB_DISABLE", "env.NCCL_SOCKET_IFNAME"))]


def killed_ranks(run: TaskRun) -> list[tuple[Line, int | None, str, str]]:
    """(line, rank, node, how) for every rank that a signal ended or a lost node took."""
    out: list[tuple[Line, int | None, str, str]] = []
    for ln in run.all_lines:
        text = bare(ln.text)
        m = SRUN_TASK.search(text)
        if m:
            out.append((ln, int(m.group("rank")), m.group("node"), m.group("how")))
            continue
        m = COMMAND_EXIT.search(text)
        if m and int(m.group(1)) < 0 and -int(m.group(1)) in FATAL_SIGNALS:
            out.append((ln, ln.rank, ln.node, f"killed by {FATAL_SIGNALS[-int(m.group(1))]}"))
            continue
        m = KILLED_BY.search(text)
        if m and (m.group(1) or m.group(2) or (m.group(3) and int(m.group(3)) in FATAL_SIGNALS)):
            how = m.group(1) or m.group(2) or FATAL_SIGNALS[int(m.group(3))]
            out.append((ln, ln.rank, ln.node, how))
            continue
        m = NODE_LOST.search(text)
        if m:
            out.append((ln, None, next((g for g in m.groups() if g), ""), "node failure"))
    return out
