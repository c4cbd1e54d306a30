"""Hang forensics: did the run stop making progress, and which rank did the others wait for?

The culprit is named from, in this order of trust:

1. the watchdog's own words: torch's desync report (``[Rank 2] ... didn't join collective``), a monitored
   barrier (``Rank 2 failed to pass monitoredBarrier``), the flight-recorder analysis (``missing ranks: {2}``);
2. the flight records themselves (``frtrace``: our watchdog's JSON dumps, torch's timeout pickles): the ranks
   whose record stops before the collective the others entered, and the ranks that left none;
3. stack dumps (faulthandler's, which every rank registers on SIGUSR1, or ``py-spy dump``): the ranks whose
   stacks are inside a collective wait for the ranks whose stacks are not (or that left no dump: gone);
4. the communication errors: ranks stuck in a collective time out together (or lose their peers right after);
   a rank with no such error, or one that reported it only long after the first timeout, never joined.

A hang without any of these (a run still going, or killed at walltime) is found from the metrics: no step
for ``HANG_K`` times the usual time between logged steps.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from ...train.health import frtrace
from ..evidence import Line, TaskRun
from ..findings import Evidence, Finding
from .logrules import COMM_PEER, COMM_TIMEOUT, bare, evidence_of

HANG_K = 10  # no logged step for this many times the median interval between logged steps
HANG_FLOOR_S = 30.0  # ... and never less than this
CASCADE_S = 5.0  # ranks whose communication error follows the first timeout this closely waited with it

MAX_WORLD = 1 << 20  # more ranks than any job runs: a number above it in a file is not a world size
WORLD = re.compile(r"\brank (\d+)/(\d+) \(local")  # the runtime's first line: "rank 1/4 (local 1/2, node 0/2 node1)"
NAMED = re.compile(r"\[Rank (\d+)\][^\n]*didn't join collective|Rank (\d+) failed to pass monitoredBarrier|"
                   r"missing ranks: \{([\d, ]+)\}")
TIMEOUT_MS = re.compile(r"(?:Timed out waiting|timeout\(ms\)=|Timeout\(ms\)=)\s*(\d+)")
THREAD = re.compile(r"^(?:Current thread|Thread) (?:0x[0-9a-fA-F]+|\d+)(?: \(.*\))?:?(?: \"[^\"]*\")?\s*$")
FH_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
SPY_FRAME = re.compile(r"^\s+(?P<func>\S[^()]*?) \((?P<file>[^()]+):(?P<line>\d+)\)\s*$")
ELIDED = re.compile(r"^\s+\.\.\.$")  # faulthandler's line for the frames past its 100th: the thread goes on
COLLECTIVE_FILES = ("distributed_c10d.py", "c10d_logger.py", "deepspeed/comm/", "torch/distributed/")
COLLECTIVE_FUNCS = {"all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                    "broadcast", "barrier", "monitored_barrier", "all_to_all", "all_to_all_single", "reduce", "gather",
                    "scatter", "all_gather_object", "broadcast_object_list", "allreduce", "allgather"}


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def __str__(self) -> str:
        return f"{self.func} ({self.file}:{self.line})"


@dataclass(frozen=True)
class StackDump:
    """One rank's last dump: its threads' frames, most recent call first."""

    rank: int
    at: Line  # the dump's first line
    threads: tuple[tuple[Frame, ...], ...]

    @property
    def main(self) -> tuple[Frame, ...]:
        """The main thread (the one that runs ``<module>``), else the first."""
        return next((t for t in self.threads if any(f.func == "<module>" for f in t)), self.threads[0] if self.threads else ())

    @property
    def in_collective(self) -> bool:
        return any(f.func in COLLECTIVE_FUNCS or any(s in f.file for s in COLLECTIVE_FILES) for f in self.main)

    def top(self, n: int = 3) -> str:
        """The innermost frames of the main thread outside torch.distributed (where the rank's own code stands)."""
        own = [f for f in self.main if not any(s in f.file for s in COLLECTIVE_FILES)]
        return " <- ".join(str(f) for f in (own or list(self.main))[:n])


# ---------------------------------------------------------------- stack dumps


def stack_dumps(lines: list[Line]) -> list[StackDump]:
    """Every dump in one file's lines (faulthandler's and py-spy's layouts)."""
    dumps: list[StackDump] = []
    threads: list[tuple[Frame, ...]] = []
    frames: list[Frame] = []
    start: Line | None = None
    blank = 0

    def close() -> None:
        nonlocal threads, frames, start
        if frames:
            threads.append(tuple(frames))
        if start is not None and threads:
            dumps.append(StackDump(start.rank, start, tuple(threads)))
        threads, frames, start = [], [], None

    for ln in lines:
        text = bare(ln.text).rstrip()
        if THREAD.match(text):
            if frames:
                threads.append(tuple(frames))
            frames, blank = [], 0
            start = start or ln
            continue
        m = FH_FRAME.match(text) or SPY_FRAME.match(text)
        if start is not None and m:
            frames.append(Frame(m.group("file"), int(m.group("line")), m.group("func")))
            blank = 0
        elif start is not None and frames and ELIDED.match(text):
            continue
        elif start is not None and not text.strip() and blank == 0:
            blank = 1  # threads of one dump are separated by one blank line
        elif start is not None:
            close()
    close()
    return dumps


def last_dumps(run: TaskRun) -> dict[int, StackDump]:
    out: dict[int, StackDump] = {}
    for lines in run.lines:
        for dump in stack_dumps(lines):
            if dump.rank not in out or dump.at.time >= out[dump.rank].at.time:
                out[dump.rank] = dump
    return out


# ---------------------------------------------------------------- who is there


def world_ranks(run: TaskRun) -> list[int]:
    """Every rank of the task: from the runtime's "rank r/W" line, else the spec, else the ranks that logged."""
    for ln in run.all_lines:
        m = WORLD.search(ln.text)
        if m and 0 < len(m.group(2)) <= 7 and 0 < int(m.group(2)) <= MAX_WORLD:  # a log line claiming 4e9 ranks is not believed
            return list(range(int(m.group(2))))
    slurm = found if isinstance(found := run.spec.get("slurm"), dict) else {}
    per_node = slurm.get("tasks_per_node") or slurm.get("gpus_per_node") or 0
    if isinstance(slurm.get("nodes"), int) and isinstance(per_node, int) and 0 < per_node and 0 < slurm["nodes"] * per_node <= MAX_WORLD:
        return list(range(slurm["nodes"] * per_node))
    return sorted({ln.rank for ln in run.all_lines})


@dataclass(frozen=True)
class Culprits:
    ranks: tuple[int, ...]
    waiting: tuple[int, ...]
    how: str  # how they were found, for the finding's cause
    evidence: tuple[Evidence, ...]


def culprits(run: TaskRun) -> Culprits | None:
    world = world_ranks(run)
    named = [(ln, m) for ln in run.all_lines if (m := NAMED.search(bare(ln.text)))]
    if named:
        ranks: set[int] = set()
        for _, m in named:
            ranks |= {int(m.group(1) or m.group(2))} if (m.group(1) or m.group(2)) else {int(x) for x in m.group(3).replace(" ", "").split(",") if x}
        return Culprits(tuple(sorted(ranks)), tuple(r for r in world if r not in ranks),
                        "named by torch's collective watchdog", evidence_of(run, [ln for ln, _ in named]))
    found = _by_flight_records(run, world)
    if found is None:
        found = _by_stacks(run, world)
    return found if found is not None else _by_comm_errors(run, world)


def _by_flight_records(run: TaskRun, world: list[int]) -> Culprits | None:
    v = frtrace.verdict(run.flight, world) if run.flight else None
    if v is None:
        return None
    nodes = {**run.rank_nodes(), **frtrace.nodes_of(run.flight)}

    def shown(rank: int) -> str:
        path = str(run.flight[rank].get("_file", ""))
        try:
            return str(Path(path).relative_to(run.task_dir))
        except ValueError:
            return path

    ev = [Evidence(shown(r), None, r, nodes.get(r, ""), None,
                   f"flight record: last entered collective #{v.last[r].enqueued}, completed #{v.last[r].completed}")
          for r in v.behind]
    ev += [Evidence(shown(r), None, r, nodes.get(r, ""), None, f"flight record: waits in collective #{v.collective} {v.op}")
           for r in v.waiting[:2]]
    how = (f"its flight record stops before collective #{v.collective} {v.op}, which the others entered" if v.behind else
           f"it left no flight record while the others wait in collective #{v.collective} {v.op} (its process is gone)")
    if v.behind and v.gone:
        how += f"; rank(s) {', '.join(map(str, v.gone))} left none"
    return Culprits(v.culprits, v.waiting, how, tuple(ev))


def _by_stacks(run: TaskRun, world: list[int]) -> Culprits | None:
    dumps = last_dumps(run)
    waiting = sorted(r for r, d in dumps.items() if d.in_collective)
    if not waiting:
        return None
    elsewhere = sorted(r for r, d in dumps.items() if not d.in_collective)
    if elsewhere:
        ev = tuple(Evidence(d.at.file, d.at.number, r, d.at.node or run.rank_nodes().get(r, ""), run.step_at(d.at.time),
                            f"stack: {d.top()}") for r, d in sorted(dumps.items()) if r in elsewhere)
        return Culprits(tuple(elsewhere), tuple(waiting), "its stack is not in the collective the others wait in "
                        f"(theirs: {dumps[waiting[0]].main[0] if dumps[waiting[0]].main else '?'})", ev)
    gone = [r for r in world if r not in dumps]
    if gone:
        ev = tuple(Evidence(dumps[r].at.file, dumps[r].at.number, r, dumps[r].at.node, None, f"stack: {dumps[r].top()}") for r in waiting[:2])
        return Culprits(tuple(gone), tuple(waiting), "it left no stack dump while the others wait in a collective (its process is gone)", ev)
    return None


def _by_comm_errors(run: TaskRun, world: list[int]) -> Culprits | None:
    first: dict[int, tuple[Line, bool]] = {}  # rank -> its first communication error, and whether it is a timeout
    for ln in sorted(run.all_lines, key=lambda x: x.time):
        text = bare(ln.text)
        timeout = bool(COMM_TIMEOUT.search(text))
        if (timeout or COMM_PEER.search(text)) and ln.rank not in first:
            first[ln.rank] = (ln, timeout)
    if not first:
        return None
    timeouts = [ln.time for ln, t in first.values() if t]
    if timeouts:  # they waited out the timeout: a rank whose error came long after theirs arrived late, the culprit
        t0, window = min(timeouts), CASCADE_S
        for ln, _ in first.values():
            m = TIMEOUT_MS.search(bare(ln.text))
            if m:
                window = max(window, 0.25 * int(m.group(1)) / 1000.0)
        waiting = sorted(r for r, (ln, _) in first.items() if ln.time <= t0 + window)
    else:  # a peer's process went away: every rank that lost it was waiting on it, however late it said so (a rank
        # slowed by a loaded node logs its loss seconds after the others); the culprit is the rank that said nothing
        waiting = sorted(first)
    missing = [r for r in world if r not in waiting]
    if not waiting or not missing:
        return None
    late = [r for r in missing if r in first]
    how = ("it never reported waiting in the collective while the others " + ("timed out" if timeouts else "lost it")
           + (" (its own error came long after theirs)" if late else ""))
    ev = evidence_of(run, [first[r][0] for r in waiting], limit=2)
    own = [ln for ln in run.all_lines if ln.rank in missing and _last_words(ln)]
    return Culprits(tuple(missing), tuple(waiting), how, evidence_of(run, own, limit=2) + ev)


def _last_words(ln: Line) -> bool:
    text = bare(ln.text)
    return bool(re.search(r"\b\w*(Error|Exception):|exited with|Killed|Segmentation fault", text)) and not text.startswith(" ")


# ---------------------------------------------------------------- no progress


def stall(run: TaskRun) -> tuple[float, float, int, dict] | None:
    """(seconds without a logged step, the usual interval, line, last row) when the run stopped progressing."""
    if run.summary is not None or run.state == "COMPLETED" or run.end_time is None:
        return None
    timed = [(n, r) for n, r in run.metrics if isinstance(r.get("time"), (int, float)) and isinstance(r.get("step"), int) and "loss" in r]
    if len(timed) < 2:
        return None
    gaps = [b[1]["time"] - a[1]["time"] for a, b in zip(timed, timed[1:], strict=False) if b[1]["step"] > a[1]["step"] and b[1]["time"] > a[1]["time"]]
    if not gaps:
        return None
    usual = statistics.median(gaps)
    number, last = timed[-1]
    if any(isinstance(r.get("global_step"), int) and r.get("global_step") >= last["step"] for r in run.requeues):
        return None  # the run stopped at walltime after this step, on purpose
    quiet = run.end_time - last["time"]
    return (quiet, usual, number, last) if quiet > max(HANG_K * usual, HANG_FLOOR_S) else None


def hang(run: TaskRun) -> list[Finding]:
    stalled = stall(run)
    found = culprits(run)
    if found is None and stalled is None:
        return []
    nodes = run.rank_nodes()
    evidence: tuple[Evidence, ...] = ()
    if stalled:
        quiet, usual, number, last = stalled
        evidence += (Evidence("metrics.jsonl", number, 0, nodes.get(0, ""), last.get("step"),
                              f"last logged step {last.get('step')}; then nothing for {quiet:.0f} s (usually {usual:.1f} s between logged steps)"),)
    if found is None:
        assert stalled is not None  # both None returned above
        return [Finding("hang", f"no step finished for {stalled[0]:.0f} s after step {stalled[3].get('step')}",
                        "a rank stopped making progress; no stack dump or communication error names which",
                        "while it hangs, dump every rank's stacks: `scancel --signal=USR1 --full JOB_ID` (each rank writes them "
                        "to its log), then run doctor again; set a shorter process-group timeout (env.DEEPSPEED_TIMEOUT, minutes) "
                        "so a hang fails fast",
                        ("env.DEEPSPEED_TIMEOUT",), evidence, run.task)]
    who = ", ".join(f"rank {r} ({nodes.get(r) or '?'})" for r in found.ranks)
    since = f" after step {stalled[3].get('step')}" if stalled else ""
    waiting = found.waiting
    return [Finding(
        "hang", f"{_plural(waiting)} waited in a collective{since} for {who}, which never joined",
        f"{who}: {found.how}",
        f"look at what {who} was doing (its log, its stack above); if its node is slow or broken, exclude it "
        "(slurm.exclude) and resubmit; if its data or code path differs (an uneven last batch, a rank-only branch), "
        "make every rank call the same collectives; a shorter process-group timeout (env.DEEPSPEED_TIMEOUT, minutes) "
        "fails such a hang sooner",
        ("slurm.exclude", "env.DEEPSPEED_TIMEOUT"), found.evidence + evidence, run.task, found.ranks,
        tuple(sorted({nodes[r] for r in found.ranks if nodes.get(r)})))]


def _plural(ranks: tuple[int, ...]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (" ..." if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) != 1 else ''} {shown}" if ranks else "the other ranks"
