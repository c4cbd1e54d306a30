"""The logs of a task's ranks: where they are, one time-ordered stream, and the errors in them.

Where each rank writes (docs/ARCHITECTURE.md):

- submitit's per-rank files ``<submitit folder>/<job id>_<rank>_log.out|err``: rank 0's runtime log, every
  rank's own stdout/stderr (the in-process trainer, a crash of the runtime, submitit's wrapper);
- ``<task dir>/logs/rank-<r>.log`` (r > 0): the runtime's log lines and a ``train.command``'s output;
- ``<task dir>/slurm-*.out``: the Slurm log of a script submitted by hand (``swiftslurm render``).

Lines are stamped with the first timestamp they carry (the runtime's ``2024-05-01 12:00:00,123``,
DeepSpeed's ``[2024-05-01 ...]``, submitit's ``(2024-05-01 ...)``); a line without one (a traceback, a
``print``) takes the next stamp of its file, or the file's last write after the last stamp. Every function here but the readers
is pure; nothing prints.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from ..fsutil import Unreadable, read_tail
from ..taskdir import ATTEMPT_LINE

STAMP = re.compile(r"(\d{4}-\d\d-\d\d)[ T](\d\d:\d\d:\d\d)(?:[,.](\d{1,6}))?")
RANK_TAG = re.compile(r"\[rank (\d+) ([^\]\s]+)\]")  # the runtime's "[rank 3 node2]"
TORCH_PREFIX = re.compile(r"^\[rank\d+\]:\s?")  # torch.distributed's "[rank1]: " before a child's traceback
SUBMITIT_LOG = re.compile(r"^(?P<job>.+)_(?P<rank>\d+)_log\.(?P<stream>out|err)$")
RANK_LOG = re.compile(r"^rank-(\d+)\.log$")
TRACEBACK = "Traceback (most recent call last):"
CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
ERROR_LINE = re.compile(
    r"\b(ERROR|CRITICAL|FATAL|Fatal Python error)\b|\b\w*(Error|Exception):|(?i:\berror:|segmentation fault|"
    r"out of memory|core dumped|\bkilled\b|oom-kill|nccl warn)"
)
# an exception line whose traceback is submitit's wrapper around a failed rank: the line says all of it
WRAPPER_EXCEPTIONS = ("TaskFailed",)
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")  # CSI, OSC (links), 2-byte
# box drawing U+2500-257F, block elements U+2580-259F (bars, shades), and the ASCII tables are drawn with
BOX_CHARS = "".join(chr(c) for c in range(0x2500, 0x25A0))
RULE_CHARS = frozenset(BOX_CHARS + "-=+_|*#~.:<>/\\` \t")
PROGRESS_BAR = re.compile(r"\d+%\|.*\|\s*\d+/\d+|\d+/\d+\s*\[\d+:\d\d(?::\d\d)?<|\[\d+:\d\d(?::\d\d)?<\S*,\s*\S+(?:it|s)/(?:s|it)\]")
PADDED = 8  # trailing spaces that only a layout (rich padding a title to the table's width) writes
NOISE_PREFIXES = ("srun:", "submitit ", "slurmstepd:")  # the launchers' own lines, never a rank's reason
SUBMITIT_GENERIC = "Submitted job triggered an exception"  # submitit's ERROR line before every traceback: says nothing
RUNTIME_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:,\d+)? (?:\[rank \d+ [^\]]*\] )?(?P<level>[A-Z]+) (?P<msg>.*)$")
SCAN_BYTES = 8 << 20  # a log is read from at most its last 8 MiB (a 3-day job's log can be huge)


@dataclass(frozen=True)
class Source:
    """One log file and the rank (of one task) that wrote it."""

    path: Path
    task: int
    rank: int


@dataclass(frozen=True)
class LogLine:
    time: float
    task: int
    rank: int
    node: str
    text: str
    order: int = 0  # position in its file: keeps a file's lines in order when times tie
    attempt: str = ""  # the attempt that wrote it (taskdir.attempt_header's key: job.requeues.restarts), "" unknown

    def prefix(self, with_task: bool = False) -> str:
        return f"[{'task ' + str(self.task) + ' ' if with_task else ''}rank {self.rank} {self.node or '?'}]"


@dataclass
class ErrorReport:
    """One error, as first printed (rank, node, time, its lines), and the other ranks that printed it too."""

    task: int
    rank: int
    node: str
    time: float
    lines: list[str]
    also: list[int] = field(default_factory=list)  # other ranks of the same task with the same error

    @property
    def headline(self) -> str:
        return self.lines[-1] if self.lines else ""


# ---------------------------------------------------------------- where the logs are (reads directories)


def sources(task: int, task_dir: str, folder: str = "", job_id: str = "") -> list[Source]:
    """Every log file of one task: submitit's per-rank files of ``job_id``, the task dir's rank logs and Slurm logs."""
    found: list[Source] = []
    if folder and job_id:
        for path in sorted(Path(folder).glob(f"{_glob_escape(job_id)}_*_log.*")):
            m = SUBMITIT_LOG.match(path.name)
            if m and m.group("job") == job_id:
                found.append(Source(path, task, int(m.group("rank"))))
    if task_dir:
        logs = Path(task_dir, "logs")
        for path in sorted(logs.glob("rank-*.log")) if logs.is_dir() else []:
            m = RANK_LOG.match(path.name)
            if m:
                found.append(Source(path, task, int(m.group(1))))
        found += [Source(p, task, 0) for p in sorted(Path(task_dir).glob("slurm-*.out"))]
    return found


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


# ---------------------------------------------------------------- reading


def read_text(path: Path, offset: int = 0, max_bytes: int = SCAN_BYTES) -> tuple[str, int]:
    """Complete lines of ``path`` from ``offset`` (at most the last ``max_bytes``): (text, new offset)."""
    try:  # a regular file only (a FIFO in a log's place would block forever), at most its last max_bytes
        chunk, start = read_tail(path, offset, max_bytes)
    except (OSError, Unreadable):
        return "", offset
    if start < offset:  # truncated or replaced: read again from its start
        offset = 0
    if start > offset:  # skipped ahead: drop the partial first line
        cut = chunk.find(b"\n") + 1
        chunk, start = chunk[cut:], start + cut
    end = chunk.rfind(b"\n") + 1
    return chunk[:end].decode("utf-8", "replace"), start + end


def stamp_of(text: str) -> float | None:
    """Epoch seconds of the first timestamp in the head of a log line (local time, as loggers write it)."""
    m = STAMP.search(text[:64])
    if not m:
        return None
    try:
        whole = time.mktime(time.strptime(f"{m.group(1)} {m.group(2)}", "%Y-%m-%d %H:%M:%S"))
    except (ValueError, OverflowError):
        return None
    return whole + (int(m.group(3)) / 10 ** len(m.group(3)) if m.group(3) else 0.0)


def stamp_lines(text: str, source: Source, end_time: float, nodes: dict[int, str], first_order: int = 0, attempt: str = "") -> list[LogLine]:
    """A file's lines with times and nodes, and ``nodes`` (rank -> latest node) filled from the runtime's rank tags.

    A line without a stamp (a traceback, a print) takes the next stamp in the file, or ``end_time`` (the
    file's mtime) after the last one: never earlier than it was written, so a crash is not placed before
    another rank's earlier one.
    """
    raw = text.splitlines()
    stamps = [stamp_of(line) for line in raw]
    line_nodes, node = [], ""
    attempts: list[str] = []
    for line in raw:  # a requeued rank may come back on another node: each line has the node of the last tag before it
        tag = RANK_TAG.search(line[:96])
        if tag:
            nodes[int(tag.group(1))] = tag.group(2)
            if int(tag.group(1)) == source.rank:
                node = tag.group(2)
        line_nodes.append(node)
        opened = ATTEMPT_LINE.search(line[:200])
        attempt = opened.group("key") if opened else attempt
        attempts.append(attempt)
    first = next((a for a in attempts if a), "")  # the launcher's lines before the first header: that attempt's
    attempts = [a or first for a in attempts]
    known = [s for s in stamps if s is not None]
    current = max([end_time, *known[-1:]])
    times = []
    for stamp in reversed(stamps):
        current = stamp if stamp is not None else current
        times.append(current)
    times.reverse()
    return [LogLine(t, source.task, source.rank, n, line, first_order + i, a)
            for i, (line, t, n, a) in enumerate(zip(raw, times, line_nodes, attempts, strict=True))]


def with_nodes(lines: Iterable[LogLine], nodes: dict[tuple[int, int], str], default: dict[int, str]) -> list[LogLine]:
    """Lines without a node (none tagged before them in their file) get their rank's: (task, rank) -> node, else the
    task's one node, else ""."""
    return [ln if ln.node else LogLine(ln.time, ln.task, ln.rank, nodes.get((ln.task, ln.rank)) or default.get(ln.task, ""), ln.text, ln.order,
                                       ln.attempt)
            for ln in lines]


def interleave(per_source: list[list[LogLine]]) -> list[LogLine]:
    """All lines by time; a file's own lines keep their order (a stable sort of already ordered files)."""
    merged = [(ln.time, i, ln.order, ln) for i, lines in enumerate(per_source) for ln in lines]
    merged.sort(key=lambda x: x[:3])
    return [x[3] for x in merged]


def select(lines: list[LogLine], rank: int | None = None, node: str | None = None, task: int | None = None,
           attempt: str | None = None) -> list[LogLine]:
    return [ln for ln in lines if (rank is None or ln.rank == rank) and (node is None or ln.node == node) and (task is None or ln.task == task)
            and (attempt is None or ln.attempt == attempt)]


def attempts(lines: Iterable[LogLine]) -> list[str]:
    """The attempts the lines come from, in the order they started (``logs --attempt N`` is the N-th)."""
    first: dict[str, float] = {}
    for ln in lines:
        if ln.attempt and (ln.attempt not in first or ln.time < first[ln.attempt]):
            first[ln.attempt] = ln.time
    return sorted(first, key=lambda key: first[key])


class Reader:
    """The logs of a submission's tasks, read once or as they grow (each call returns what is new)."""

    def __init__(self, tasks: list[tuple[int, str, str, str]], task_nodes: dict[int, str] | None = None) -> None:
        """``tasks``: (task index, task dir, submitit folder, job id) each; ``task_nodes``: the one node a task ran on."""
        self.tasks = tasks
        self.task_nodes = task_nodes or {}
        self.offsets: dict[Path, int] = {}
        self.orders: dict[Path, int] = {}
        self.nodes: dict[tuple[int, int], str] = {}
        self.attempts: dict[Path, str] = {}

    def new_lines(self, max_bytes: int = SCAN_BYTES) -> list[list[LogLine]]:
        """Per log file, the complete lines added since the last call (the first call: the last ``max_bytes``)."""
        per_source = []
        for task, task_dir, folder, job_id in self.tasks:
            for src in sources(task, task_dir, folder, job_id):
                first = src.path not in self.offsets
                text, self.offsets[src.path] = read_text(src.path, self.offsets.get(src.path, 0), max_bytes if first else SCAN_BYTES)
                if not text:
                    continue
                try:
                    mtime = src.path.stat().st_mtime
                except OSError:
                    mtime = time.time()
                if not first:
                    mtime = time.time()  # appended lines of a follow: written just now
                ranks: dict[int, str] = {}
                lines = stamp_lines(text, src, mtime, ranks, self.orders.get(src.path, 0), self.attempts.get(src.path, ""))
                self.orders[src.path] = self.orders.get(src.path, 0) + len(lines)
                if lines:
                    self.attempts[src.path] = lines[-1].attempt  # a follow's next lines continue this attempt
                for rank, node in ranks.items():
                    self.nodes[(task, rank)] = node
                per_source.append(lines)
        return [with_nodes(lines, self.nodes, self.task_nodes) for lines in per_source]


# ---------------------------------------------------------------- errors


def _bare(text: str) -> str:
    return TORCH_PREFIX.sub("", text)


def plain(text: str) -> str:
    """A log line as a person saw it: ANSI colour codes dropped, a carriage-returned progress line's last state."""
    return ANSI.sub("", text.rsplit("\r", 1)[-1] if "\r" in text.rstrip("\r") else text.rstrip("\r"))


def is_decoration(text: str, padded: bool = True) -> bool:
    """True for a line that can never say why a run failed (pure): blank, a table border or rule (rich's
    ``└───┴───┘``, ``━━ title ━━``, ASCII ``+----+``, ``=====``), a row of a table or panel (it starts with a
    box-drawing character: ``│ nodes │ localhost │``, or ASCII ``| a | b |``; the text that matters is printed
    outside the box), with ``padded`` a line padded with spaces to a layout's width (a table's centred title), or a
    progress bar (tqdm's ``40%|████      | 20/50 [00:10<00:15, 2.00it/s]``)."""
    line = plain(_bare(text)).rstrip("\n")
    t = line.strip()
    if not t or t[0] in BOX_CHARS or all(c in RULE_CHARS for c in t) or (t[0] == t[-1] == "|" and len(t) > 1):
        return True
    if padded and len(line) - len(line.rstrip()) >= PADDED:  # padded out to a layout's width: a table's title, a panel's line
        return True
    boxy = sum(c in BOX_CHARS for c in t)
    if boxy * 2 >= len(t.replace(" ", "")):  # a rule with a title in it
        return True
    return bool(PROGRESS_BAR.search(t))


def last_words(lines: list[str]) -> str | None:
    """Why a rank stopped, from the end of its stderr (pure): the last line that is not decoration, a
    launcher's line or one of the runtime's own INFO/WARNING lines (its ERROR lines count, message only). When
    that is submitit's ``TaskFailed`` ending a traceback, the line before the traceback (what the rank or its
    command said last) comes first, the wrapper's message after it in parentheses."""
    kept = []
    for raw in lines:
        if is_decoration(raw):
            continue
        t = plain(_bare(raw)).strip()
        if t.startswith(NOISE_PREFIXES):
            continue
        m = RUNTIME_LINE.match(t)
        if m:
            if m.group("level") not in ("ERROR", "CRITICAL"):
                continue
            t = m.group("msg").strip()
        kept.append(t)
    if not kept:
        return None
    last = kept[-1]
    if last.split(":", 1)[0].rsplit(".", 1)[-1] in WRAPPER_EXCEPTIONS and TRACEBACK in kept:
        message = last.split(": ", 1)[-1]
        start = len(kept) - 1 - kept[::-1].index(TRACEBACK)
        if ": " in message.split(" on this rank", 1)[-1]:  # the wrapper carries the reason itself
            return message[:600]
        if start > 0:
            return f"{kept[start - 1][:300]} ({message})"
        return message[:300]
    return last[:300]


def error_blocks(lines: list[LogLine]) -> list[tuple[LogLine, list[str]]]:
    """Tracebacks (whole, chained ones together) and single error lines of ONE source, in order."""
    out: list[tuple[LogLine, list[str]]] = []
    i = 0
    while i < len(lines):
        text = _bare(lines[i].text)
        if text.strip() == TRACEBACK:
            start, block, i = lines[i], [text], i + 1
            while i < len(lines):
                t = _bare(lines[i].text)
                block.append(t)
                i += 1
                if t and not t[0].isspace() and t.strip() != TRACEBACK:
                    # the exception line ends it, unless a chained traceback follows
                    nxt = next((_bare(x.text) for x in lines[i:i + 3] if _bare(x.text).strip()), "")
                    if nxt.startswith(CHAINED) or nxt.strip() == TRACEBACK:
                        continue
                    if t.startswith(CHAINED):
                        continue
                    break
            block = [b for b in block if b.strip()]
            if block and any(block[-1].split(":")[0].endswith(w) for w in WRAPPER_EXCEPTIONS):
                block = block[-1:]
            out.append((start, block))
            continue
        if ERROR_LINE.search(text) and not is_decoration(text, padded=False) and not text.rstrip().endswith(SUBMITIT_GENERIC):
            out.append((lines[i], [plain(text)]))
        i += 1
    return out


def _key(text: str) -> str:
    """What makes two ranks' errors the same: the text without stamps, rank tags, numbers of ranks or pids."""
    text = STAMP.sub("", _bare(text))
    text = RANK_TAG.sub("", text)
    return re.sub(r"\b(rank|pid|Rank)\s*\d+", r"\1 N", text).strip()


def find_errors(per_source: list[list[LogLine]]) -> list[ErrorReport]:
    """Errors of every source, the same error printed by several ranks reported once, by the rank that
    printed it first (earliest time); reports ordered by that time (the first one is likely the cause)."""
    reports: dict[tuple[int, str], ErrorReport] = {}
    for lines in per_source:
        for first, block in error_blocks(lines):
            key = (first.task, _key(block[-1]))
            seen = reports.get(key)
            if seen is None:
                reports[key] = ErrorReport(first.task, first.rank, first.node, first.time, block)
            elif first.time < seen.time or (first.time == seen.time and first.rank < seen.rank):
                others = sorted(set(seen.also) | {seen.rank} - {first.rank})
                reports[key] = ErrorReport(first.task, first.rank, first.node, first.time, block, others)
            elif first.rank != seen.rank and first.rank not in seen.also:
                seen.also = sorted({*seen.also, first.rank})
    return sorted(reports.values(), key=lambda r: (r.time, r.task, r.rank))
