"""Check results and the pure decisions made over them.

A check never raises for a broken node or a missing tool: it returns ``CheckResult``s with
``ok=False`` and a hint. ``blamed_nodes`` and ``decide`` turn a list of results into what the
gate does (continue, warn, exclude these nodes and requeue, abort); both are pure.
"""

from __future__ import annotations

import shutil
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

INSTALL_HINTS = {
    "nc": "install netcat: `apt-get install netcat-openbsd` (Debian/Ubuntu) or `dnf install nmap-ncat`",
    "iperf3": "install iperf3: `apt-get install iperf3` or `dnf install iperf3`",
    "fio": "install fio: `apt-get install fio` or `dnf install fio`",
    "nvidia-smi": "install the NVIDIA driver utilities (nvidia-smi), or ask the admins why this GPU node lacks them",
}


@dataclass(frozen=True)
class CheckResult:
    """One observation: ``node`` is a node name or a pair ``"node1->node2"`` (or ``"all"``)."""

    check: str
    node: str
    ok: bool
    observed: str
    expected: str = ""
    hint: str = ""
    data: dict[str, Any] = field(default_factory=dict)  # numbers for plots/JSON (e.g. the busbw sweep)
    warn_only: bool = False  # a miss of a floor the spec did not set: reported, never a reason to stop

    @property
    def blocking(self) -> bool:
        """A failure that on_failure acts on (not a warning)."""
        return not self.ok and not self.warn_only

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "CheckResult":
        return cls(d["check"], d["node"], bool(d["ok"]), d["observed"], d.get("expected", ""), d.get("hint", ""), d.get("data") or {},
                   bool(d.get("warn_only", False)))

    @property
    def nodes(self) -> tuple[str, ...]:
        """The node names this result is about (both ends of a pair; none for ``all``)."""
        if self.node == "all":
            return ()
        return tuple(n for n in self.node.split("->") if n)


def missing_tool(check: str, node: str, tool: str) -> CheckResult:
    """The result for a tool that is not on PATH: a failed check with an install hint."""
    return CheckResult(check, node, False, f"'{tool}' not found on PATH", f"'{tool}' installed", INSTALL_HINTS.get(tool, f"install {tool}"))


def which(tool: str) -> str | None:
    return shutil.which(tool)


def blamed_nodes(results: Iterable[CheckResult]) -> list[str]:
    """The nodes the failures point at (pure).

    A failed single-node result blames its node. A failed pair result gives each end a point;
    the nodes with the most points are blamed (a node nobody can reach appears in every failing
    pair, its peers once each). Results about ``all`` blame nobody.
    """
    single: set[str] = set()
    pair_score: Counter[str] = Counter()
    for r in results:
        if not r.blocking:
            continue
        names = r.nodes
        if len(names) == 1:
            single.add(names[0])
        elif len(names) == 2 and names[0] != names[1]:
            pair_score.update(names)
        elif len(names) == 2:
            single.add(names[0])
    blamed = set(single)
    if pair_score:
        top = max(pair_score.values())
        blamed |= {n for n, s in pair_score.items() if s == top}
    return sorted(blamed)


@dataclass(frozen=True)
class Decision:
    """What the gate does: ``action`` is continue | warn | exclude | abort."""

    action: str
    proceed: bool  # train after the preflight?
    exclude: tuple[str, ...] = ()
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"action": self.action, "proceed": self.proceed, "exclude": list(self.exclude), "reason": self.reason}


def failed(results: Iterable[CheckResult]) -> list[CheckResult]:
    """The failures on_failure acts on (warnings left out)."""
    return [r for r in results if r.blocking]


def _summary(bad: list[CheckResult]) -> str:
    return "; ".join(f"{r.check} {r.node}: {r.observed}" for r in bad[:6]) + (f"; (+{len(bad) - 6} more)" if len(bad) > 6 else "")


FATAL_CHECKS = ("process-group",)  # failures no on_failure may train past


def decide(results: list[CheckResult], on_failure: str, nodes: Iterable[str], mode: str = "train") -> Decision:
    """The gate's decision over the results (pure). ``nodes``: the job's allocation."""
    bad = failed(results)
    if not bad:
        warned = [r for r in results if not r.ok]
        if warned:
            return Decision("warn", True, reason=f"{len(warned)} check(s) below a default floor, which only warns (set the "
                            f"preflight.min_* key to make it binding): {_summary(warned)}")
        return Decision("continue", True, reason="all checks passed")
    summary = _summary(bad)
    if mode == "preflight":
        return Decision("abort", False, reason=f"{len(bad)} check(s) failed: {summary}")
    if any(r.check in FATAL_CHECKS for r in bad):
        return Decision("abort", False, reason=f"{len(bad)} check(s) failed, one that no on_failure trains past: {summary}")
    if on_failure == "warn":
        return Decision("warn", True, reason=f"{len(bad)} check(s) failed, training anyway (on_failure = 'warn'): {summary}")
    if on_failure == "exclude":
        allocation = sorted(set(nodes))
        blamed = [n for n in blamed_nodes(bad) if n in allocation]
        if not blamed:
            return Decision("abort", False, reason=f"on_failure = 'exclude' but no single node is to blame ({summary}); not requeueing")
        if len(blamed) >= len(allocation):
            return Decision("abort", False,
                            reason=f"on_failure = 'exclude' but every node failed ({', '.join(blamed)}): the fault is not node-specific; not "
                                   f"requeueing. {summary}")
        return Decision("exclude", False, tuple(blamed), f"excluding {', '.join(blamed)} and requeueing: {summary}")
    return Decision("abort", False, reason=f"{len(bad)} check(s) failed (on_failure = 'abort'): {summary}")
