"""PyTorch's flight recorder (FR): dump this rank's record of its collectives, and read the dumps (pure).

Every rank records its last ``TORCH_FR_BUFFER_SIZE`` collectives (set by ``distenv.child_env``; gloo records
too, since torch 2.8). NCCL dumps the record itself on a collective timeout (``TORCH_NCCL_DUMP_ON_TIMEOUT``,
a pickle at ``$TORCH_FR_DUMP_TEMP_FILE<rank>``); the progress watchdog dumps it earlier, as JSON at
``$TORCH_FR_DUMP_TEMP_FILE<rank>.json``, from its own thread while the main thread is stuck. The analysis
is the flight-recorder tool's first question: in each process group, the newest collective some rank waits
in, and the ranks that never enqueued it (the culprits) or left no record (gone).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...fsutil import DUMP_CAP, Unreadable, atomic_write_text, loads_json, plain_unpickle, read_bytes

PREFIX_ENV = "TORCH_FR_DUMP_TEMP_FILE"


# ---------------------------------------------------------------- the rank's side


def dump_json() -> dict[str, Any] | None:
    """This rank's flight record, or None (no torch.distributed, no FR in this torch, nothing recorded). NCCL
    keeps its own recorder (``_dump_nccl_trace_json``, CUDA builds) beside the one of gloo and the other CPU
    backends (``_dump_fr_trace_json``): both are read, their entries and process-group states merged."""
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return None
    merged: dict[str, Any] | None = None
    for name in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            data = json.loads(dump(True, True))  # includeCollectives, onlyActive
        except Exception:  # noqa: BLE001 -- forensics never fail the run (no recorder, torn output, ...)
            continue
        if not isinstance(data, dict):
            continue
        if merged is None:
            merged = data
        else:
            merged["entries"] = list(merged.get("entries") or []) + list(data.get("entries") or [])
            merged["pg_status"] = {**(data.get("pg_status") or {}), **(merged.get("pg_status") or {})}
    return merged


def dump_path(prefix: str, rank: int) -> Path:
    return Path(f"{prefix}{rank}.json")


def write_dump(prefix: str, rank: int, node: str, when: float) -> Path | None:
    """This rank's record at ``<prefix><rank>.json`` (atomic), with who wrote it and when; None without one."""
    data = dump_json()
    if data is None or not prefix:
        return None
    data["swiftslurm"] = {"rank": rank, "node": node, "time": when}
    path = dump_path(prefix, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(data))
    except OSError:
        return None
    return path


# ---------------------------------------------------------------- reading dumps (pure)


def read_dump(path: Path) -> dict[str, Any] | None:
    """A dump as a dict: our JSON, or torch's pickle (plain types only: torch's own dumps are pickles of plain
    dicts, lists and scalars); None when unreadable (over DUMP_CAP, not a regular file, torn, foreign, hostile)."""
    try:
        raw = read_bytes(path, DUMP_CAP)
    except (OSError, ValueError):
        return None
    try:
        data = loads_json(raw, source=path)
    except Unreadable:
        try:
            data = plain_unpickle(raw, source=path)
        except Unreadable:
            return None
    return data if isinstance(data, dict) else None


@dataclass(frozen=True)
class Position:
    """Where one rank stands in one process group."""

    rank: int
    pg: str  # the process group's id in the dump ("0": the default group)
    enqueued: int  # the newest collective this rank entered (its sequence number in the group)
    completed: int  # the newest one it saw finish
    op: str  # what the newest entered one is ("gloo:all_reduce", "nccl:all_gather", ...)

    @property
    def waiting(self) -> bool:
        return self.enqueued > self.completed


def _int(value: Any, default: int = -1) -> int:
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):  # a dump is data we did not write: inf, text, anything
        return default


def positions(dump: dict[str, Any], rank: int) -> list[Position]:
    """One position per process group in a dump (from ``pg_status``, the op from its entries)."""
    entries = dump.get("entries")
    entries = [e for e in entries if isinstance(e, dict)] if isinstance(entries, (list, tuple)) else []
    status = dump.get("pg_status") or {}
    out = []
    for pg, st in sorted(status.items(), key=lambda kv: str(kv[0])) if isinstance(status, dict) else []:  # keys of mixed kinds
        if not isinstance(st, dict):
            continue
        enq = _int(st.get("last_enqueued_collective"))
        done = _int(st.get("last_completed_collective"))
        op = next((str(e.get("profiling_name", "")) for e in reversed(entries)
                   if str(e.get("pg_id")) == str(pg) and _int(e.get("collective_seq_id")) == enq), "")
        out.append(Position(rank, str(pg), enq, done, op))
    return out


@dataclass(frozen=True)
class Verdict:
    """The collective some ranks wait in, and who is not there."""

    pg: str
    collective: int  # its sequence number in the group
    op: str
    waiting: tuple[int, ...]  # ranks inside it
    behind: tuple[int, ...]  # ranks whose record stops before it: they never entered it
    gone: tuple[int, ...]  # ranks of the world that left no record at all
    last: dict[int, Position]  # each rank's position in that group

    @property
    def culprits(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.behind) | set(self.gone)))


def verdict(records: dict[int, dict[str, Any]], world: list[int]) -> Verdict | None:
    """Pure: from every rank's dump (rank -> dump), the collective the others wait in and the ranks missing
    from it. The default group first, then the group where the most ranks wait. None when nobody waits, or
    everybody who waits waits together (no one is missing)."""
    by_pg: dict[str, dict[int, Position]] = {}
    for rank, dump in records.items():
        for p in positions(dump, rank):
            by_pg.setdefault(p.pg, {})[rank] = p
    candidates = []
    for pg, ranks in by_pg.items():
        newest = max(p.enqueued for p in ranks.values())
        waiting = tuple(sorted(r for r, p in ranks.items() if p.enqueued == newest and p.waiting))
        if not waiting:
            continue
        behind = tuple(sorted(r for r, p in ranks.items() if p.enqueued < newest))
        gone = tuple(r for r in world if r not in records) if pg == "0" else ()
        if behind or gone:
            op = next(p.op for p in ranks.values() if p.enqueued == newest)
            candidates.append(Verdict(pg, newest, op, waiting, behind, gone, dict(ranks)))
    if not candidates:
        return None
    candidates.sort(key=lambda v: (v.pg != "0", -len(v.waiting)))
    return candidates[0]


def describe(v: Verdict, nodes: dict[int, str]) -> list[str]:
    """Rank 0's log lines: which collective each rank is in, then who the others wait for."""
    def who(r: int) -> str:
        return f"rank {r} ({nodes.get(r) or '?'})"

    lines = []
    for r in sorted(set(v.last) | set(v.gone)):
        p = v.last.get(r)
        if p is None:
            lines.append(f"{who(r)}: no flight record (its process is gone, or it is stuck outside Python)")
        elif p.enqueued == v.collective and p.waiting:
            lines.append(f"{who(r)}: waits in collective #{v.collective} {v.op} (process group {v.pg})")
        else:
            lines.append(f"{who(r)}: last entered collective #{p.enqueued}, completed #{p.completed}: not in #{v.collective}")
    culprits = ", ".join(who(r) for r in v.culprits)
    lines.append(f"hang: {culprits} never joined collective #{v.collective} {v.op} that "
                 f"rank{'s' if len(v.waiting) != 1 else ''} {', '.join(map(str, v.waiting))} wait{'' if len(v.waiting) != 1 else 's'} in")
    return lines


def nodes_of(records: dict[int, dict[str, Any]]) -> dict[int, str]:
    """rank -> node, from the header the watchdog writes into each dump."""
    out = {}
    for rank, dump in records.items():
        head = dump.get("swiftslurm")
        if isinstance(head, dict) and head.get("node"):
            out[rank] = str(head["node"])
    return out


def read_dumps(prefix: str, since: float | None = None) -> dict[int, dict[str, Any]]:
    """Every rank's dump under ``prefix`` (each with its path under ``_file``) (``<prefix><rank>`` pickles and ``<prefix><rank>.json``), the JSON
    one when both exist; only files written at or after ``since``."""
    base = Path(prefix)
    out: dict[int, dict[str, Any]] = {}
    if not base.parent.is_dir():
        return out
    for path in sorted(base.parent.glob(base.name + "*")):
        tail = path.name[len(base.name):]
        number = tail[:-5] if tail.endswith(".json") else tail
        if not number.isdigit():
            continue
        try:
            if since is not None and path.stat().st_mtime < since:
                continue
        except OSError:
            continue
        data = read_dump(path)
        if data is not None and (int(number) not in out or path.suffix == ".json"):
            data["_file"] = str(path)  # where it was read from (evidence)
            out[int(number)] = data
    return out
