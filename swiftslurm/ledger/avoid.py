"""Which recently failed nodes a submission excludes (pure).

A bad node joins ``--exclude`` unless the job names it (``slurm.nodelist``: excluding it would leave the job
pending forever) or excluding it would leave the partition fewer usable nodes than the job asks for; then it
stays eligible and the submission says why. When only some can go, the most recently failed go first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .store import Entry


def _expand(hostlist_text: str | None) -> list[str]:
    import hostlist

    return list(hostlist.expand_hostlist(hostlist_text)) if hostlist_text else []


def _collect(names: list[str]) -> str:
    import hostlist

    return hostlist.collect_hostlist(sorted(set(names)))


@dataclass(frozen=True)
class Avoidance:
    excluded: tuple[str, ...] = ()  # bad nodes this submission adds to --exclude
    kept: tuple[str, ...] = ()  # bad nodes it could not exclude (named in nodelist, or too few nodes left)
    exclude: str | None = None  # the --exclude the job gets (the user's merged with ``excluded``)
    notes: tuple[str, ...] = ()  # what to tell the user, one line each
    why: dict[str, str] = field(default_factory=dict)  # node -> its latest failure, in words

    def to_json(self) -> dict[str, Any]:
        return {"excluded": list(self.excluded), "kept": list(self.kept), "exclude": self.exclude,
                "notes": list(self.notes), "why": dict(self.why)}


def describe(entries: list[Entry]) -> str:
    """``preflight in job 123 (ports node1->node3: refused)``: the newest of a node's entries, and how many more."""
    e = entries[0]
    more = f" (+{len(entries) - 1} earlier)" if len(entries) > 1 else ""
    return f"{e.reason} in job {e.job or '?'}: {e.detail}"[:200] + more


def avoid(bad: dict[str, list[Entry]], user_exclude: str | None, nodelist: str | None,
          partition_nodes: list[str] | None, nodes_needed: int) -> Avoidance:
    """The exclusion for one allocation. ``bad``: ``store.recent(...)``; ``partition_nodes``: the usable nodes of the
    job's partition (None: unknown, then every bad node is excluded)."""
    user = set(_expand(user_exclude))
    required = set(_expand(nodelist))
    why = {n: describe(es) for n, es in bad.items()}
    candidates = [n for n in sorted(bad, key=lambda n: -bad[n][0].when) if n not in user]
    notes: list[str] = []
    pinned = sorted(n for n in candidates if n in required)
    if pinned:
        notes.append(f"not excluding {_collect(pinned)}: slurm.nodelist names it (excluding it would leave the job pending forever)")
    candidates = [n for n in candidates if n not in required]
    if partition_nodes is not None:
        known = set(partition_nodes)
        candidates = [n for n in candidates if n in known]  # a node of another partition is no concern of this job
        room = len(known - user) - nodes_needed
        if len(candidates) > max(room, 0):
            left_out = sorted(candidates[max(room, 0):])
            candidates = candidates[:max(room, 0)]
            notes.append(f"not excluding {_collect(left_out)}: the partition has {len(known - user)} usable node(s) and the job "
                         f"needs {nodes_needed}; excluding {'them' if len(left_out) > 1 else 'it'} would leave the job unsatisfiable, "
                         "so it may land there (fix the node, then `swiftslurm nodes --clear NODE`)")
            pinned += left_out
    if not candidates:
        return Avoidance((), tuple(pinned), user_exclude, tuple(notes), why)
    excluded = tuple(sorted(candidates))
    notes.insert(0, f"excluding {_collect(list(excluded))} (recently failed: "
                 + "; ".join(f"{n}: {why[n]}" for n in excluded[:3]) + (" ..." if len(excluded) > 3 else "") + ")")
    return Avoidance(excluded, tuple(pinned), _collect([*user, *excluded]), tuple(notes), why)
