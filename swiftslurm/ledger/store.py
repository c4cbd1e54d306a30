"""The ledger file: a JSON list of entries (node, reason, detail, job, when, source), one per failure seen.

Writers take an exclusive ``fcntl.lockf`` lock on a sibling ``.lock`` file (NFS's lock manager honours it), read,
change and atomically replace the file; readers need no lock (they see the old list or the new). A torn or
foreign file is one error that says how to start over (``swiftslurm nodes --clear-all``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from ..errors import SwiftSlurmError
from ..fsutil import LEDGER_CAP, Unreadable, atomic_write_text, loads_json, read_bytes

LEDGER_ENV = "SWIFTSLURM_LEDGER"  # a file path; tests point it into their tmp dir
DEFAULT_LEDGER = "~/.swiftslurm/ledger.json"
MAX_WHEN = 1e11  # epoch seconds: year 5138; a later "when" is not a time
REASONS = ("preflight", "hang", "node_failure", "slow")
# "slow" (a straggler: train/health/straggler.py) is a mark to look at, not a verdict: the node still works, and
# excluding it could leave a job pending for want of nodes. Every other reason makes a node bad: `submit` excludes it.
MARK_REASONS = ("slow",)
# a Slurm node name as sinfo prints one (no hostlist brackets or commas, no spaces): "gpu[07" from a torn log line
# would break every `plan` that excludes it
NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def valid_node_name(name: str) -> bool:
    return bool(NODE_NAME.match(name))


@dataclass(frozen=True)
class Entry:
    node: str
    reason: str  # preflight | hang | node_failure (bad: excluded) | slow (a straggler: shown, never excluded)
    detail: str  # what was seen, one line (the failed checks, the rank and how it ended)
    job: str = ""  # the Slurm job id
    when: float = 0.0  # epoch seconds
    source: str = ""  # the task dir (or output dir) whose files showed it

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Entry":
        """An entry from the file, or ValueError saying what is wrong with it (for ``read``'s dropped list)."""
        if not isinstance(data, dict):
            raise ValueError(f"an entry is a JSON object, not {type(data).__name__}")
        when = data.get("when", 0.0)
        if isinstance(when, bool) or not isinstance(when, (int, float)) or not 0 <= when < MAX_WHEN:  # 1e300: no date
            raise ValueError(f"'when' {str(when)[:40]!r} is not a time (epoch seconds)")
        fields = {k: data.get(k, "") for k in ("node", "reason", "detail", "job", "source")}
        if not all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in fields.values()):
            raise ValueError("node, reason, detail, job and source are strings")
        node = str(fields["node"])
        if not valid_node_name(node):
            raise ValueError(f"{node[:60]!r} is not a node name")
        return cls(node, str(fields["reason"])[:64], str(fields["detail"])[:2000], str(fields["job"])[:64], float(when),
                   str(fields["source"])[:4096])

    @property
    def key(self) -> tuple[str, str, str]:
        """One entry per node, reason and job: doctor run twice on one job records it once."""
        return (self.node, self.reason, self.job)


def ledger_path(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    return Path(os.path.expanduser(env.get(LEDGER_ENV) or DEFAULT_LEDGER))


def _parse(path: Path, raw: bytes, dropped: list[str] | None) -> list[Entry]:
    try:
        data = loads_json(raw, source=path) if raw.strip() else []
        if not isinstance(data, list):
            raise ValueError("not a JSON list")
    except Unreadable as exc:
        raise SwiftSlurmError(f"the node-health ledger {path} cannot be read", exc.why[:300],
                              f"fix it by hand, or start it over with `swiftslurm nodes --clear-all` (or point ${LEDGER_ENV} elsewhere)") from None
    except ValueError as exc:
        raise SwiftSlurmError(f"the node-health ledger {path} cannot be read", str(exc)[:300],
                              f"fix it by hand, or start it over with `swiftslurm nodes --clear-all` (or point ${LEDGER_ENV} elsewhere)") from None
    entries = []
    for i, item in enumerate(data):
        try:
            entries.append(Entry.from_json(item))
        except ValueError as exc:  # one bad entry (a torn node name, a date out of range) is left out, not the ledger
            if dropped is not None:
                dropped.append(f"entry {i}: {exc}")
    return entries


def read(path: Path | None = None, dropped: list[str] | None = None) -> list[Entry]:
    """Every entry, oldest first; [] when there is no ledger yet. An entry that is not one (a bad node name or
    time) is left out, and said in ``dropped`` when given; the next write drops it from the file."""
    path = ledger_path() if path is None else Path(path)
    try:
        raw = read_bytes(path, LEDGER_CAP)  # a regular file under its cap (a FIFO here would hang every plan)
    except FileNotFoundError:
        return []
    except Unreadable as exc:
        raise SwiftSlurmError(f"the node-health ledger {path} cannot be read", exc.why,
                              f"check it (and its permissions), or point ${LEDGER_ENV} elsewhere") from None
    return _parse(path, raw, dropped)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def _update(path: Path | None, change: Callable[[list[Entry]], list[Entry]], tolerate_torn: bool = False) -> tuple[list[Entry], list[Entry]]:
    """(before, after): ``change`` applied under the lock, written atomically when it changed something."""
    path = ledger_path() if path is None else Path(path)
    with _locked(path):
        try:
            before = read(path)
        except SwiftSlurmError:
            if not tolerate_torn:
                raise
            before = []
        after = change(list(before))
        if after != before or tolerate_torn:
            atomic_write_text(path, json.dumps([e.to_json() for e in after], indent=1) + "\n")
    return before, after


def record(entries: Iterable[Entry], path: Path | None = None) -> list[Entry]:
    """Add ``entries`` (``when`` 0 means now); one already there (same node, reason and job) is not added twice,
    one whose node is not a node name (``gpu[07`` from a torn log line) not at all. Returns the entries added."""
    now = time.time()
    new = [e if e.when else Entry(e.node, e.reason, e.detail, e.job, now, e.source) for e in entries if valid_node_name(e.node)]
    added: list[Entry] = []

    def change(current: list[Entry]) -> list[Entry]:
        seen = {e.key for e in current}
        for e in new:
            if e.key not in seen:
                seen.add(e.key)
                added.append(e)
        return current + added

    if new:
        _update(path, change)
    return added


def clear(nodes: Iterable[str] | None, path: Path | None = None) -> list[Entry]:
    """Forget ``nodes`` (every node: None). Returns the entries removed. Clearing every node also starts over a
    ledger that cannot be read."""
    names = None if nodes is None else set(nodes)
    before, after = _update(path, lambda cur: [] if names is None else [e for e in cur if e.node not in names],
                            tolerate_torn=names is None)
    return [e for e in before if e not in after]


def recent(entries: Iterable[Entry], now: float, ttl_h: float) -> dict[str, list[Entry]]:
    """Each node with a failure (an entry of any reason but the ``MARK_REASONS``: a ``slow`` mark is none) in the last
    ``ttl_h`` hours: its entries, newest first (pure)."""
    out: dict[str, list[Entry]] = {}
    for e in sorted(entries, key=lambda e: -e.when):
        if e.reason not in MARK_REASONS and now - e.when <= ttl_h * 3600.0:
            out.setdefault(e.node, []).append(e)
    return out
