"""A finding: one thing that went wrong (or slow), with its evidence, cause and fix (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Every code doctor emits, most important first: the order findings are shown in. A root cause comes
# before what it causes (a hang or a lost node makes the other ranks' collectives time out).
CODES = (
    "hang",  # no step progress for K x the median step time; names the rank(s) the others wait for
    "startup_hang",  # a rank ended by the start-up watch (train/health/startup.py): stuck before training, e.g. on a build lock
    "held",  # Slurm holds the job in the queue (launch failed requeued held, an admin's or the user's hold): it never starts alone
    "node_failure",  # a node lost, a rank killed by a signal, a failed preflight
    "host_oom",  # the kernel's OOM killer ended a rank (host memory, not the GPU's)
    "cuda_oom",  # CUDA out of memory
    "device_mismatch",  # "Expected all tensors to be on the same device" (offload settings)
    "ckpt_missing_keys",  # missing/unexpected keys loading a checkpoint
    "nccl_timeout",  # NCCL / gloo / process-group / rendezvous timeouts, watchdog aborts
    "nan_grad_norm",  # grad_norm or loss NaN/inf for NAN_STEPS consecutive logged steps
    "diverged",  # loss (or grad norm) ended far above its first logged values, all finite
    "router_collapse",  # an MoE router sent nearly every token to the same experts for ROUTER_ROWS logs in a row
    "walltime_loop",  # requeued at walltime again and again without progress
    "straggler",  # a rank slower than the others' median for several windows in a row (train/health/straggler.py)
    "low_gpu_util",  # speed, step 1: GPUs idle more than 15% of the time
    "comm_bound",  # speed, step 2: collectives take over 30% of a step
    "data_bound",  # speed, step 3: the data loader keeps the GPUs waiting
)


@dataclass(frozen=True)
class Evidence:
    """Where a finding was seen: a file and line, or a metrics row; the rank, node and step when known."""

    file: str = ""
    line: int | None = None
    rank: int | None = None
    node: str = ""
    step: int | None = None
    text: str = ""  # the line (or value) as found

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "rank": self.rank, "node": self.node, "step": self.step, "text": self.text}

    def where(self) -> str:
        """``logs/rank-2.log:17 rank 2 node3 step 40`` (the parts known)."""
        parts = [f"{self.file}:{self.line}" if self.file and self.line else self.file]
        parts += [f"rank {self.rank}" if self.rank is not None else "", self.node, f"step {self.step}" if self.step is not None else ""]
        return " ".join(p for p in parts if p)


@dataclass(frozen=True)
class Finding:
    code: str
    what: str  # what happened, one sentence
    cause: str  # why, as far as the files tell
    fix: str  # what to do
    keys: tuple[str, ...] = ()  # the spec keys the fix changes
    evidence: tuple[Evidence, ...] = ()
    task: int = 0
    ranks: tuple[int, ...] = ()  # the ranks it concerns (a hang: the culprits)
    nodes: tuple[str, ...] = ()  # the nodes it concerns (a hang: the culprits' nodes)

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise ValueError(f"unknown finding code {self.code!r}")

    @property
    def rank_order(self) -> int:
        return CODES.index(self.code)

    def to_json(self) -> dict[str, Any]:
        return {
            "code": self.code, "task": self.task, "what": self.what, "cause": self.cause, "fix": self.fix,
            "keys": list(self.keys), "ranks": list(self.ranks), "nodes": list(self.nodes),
            "evidence": [e.to_json() for e in self.evidence],
        }


def ordered(findings: list[Finding]) -> list[Finding]:
    """Most important first: by code (root causes before symptoms), then task, then first evidence time order kept."""
    return sorted(findings, key=lambda f: (f.rank_order, f.task))
