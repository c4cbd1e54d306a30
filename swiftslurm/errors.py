"""Typed errors for people.

Library code raises these; only the CLI turns them into rich output and exit codes.
Every error says what is wrong, what was found, and what to do (the hint).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """"did you mean 'x'?" for the closest of ``choices`` to ``word``, or "" when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else ""


# `swiftslurm doctor` found something (not an error of swiftslurm's: the job's). SPEC.md's exit codes:
# 1 job failed, 2 bad spec, 3 submission refused, 4 preflight failed, 5 checkpoint damaged, 6 doctor findings.
FINDINGS_EXIT = 6


class SwiftSlurmError(Exception):
    """Base of every user-facing error. ``exit_code`` follows SPEC.md."""

    exit_code = 1
    agreed = False  # raised alike on every rank from one verdict (train.resume.source): the ranks may leave together

    def __init__(self, what: str, found: str = "", hint: str = "") -> None:
        self.what = what
        self.found = found
        self.hint = hint
        super().__init__(self.message())

    def message(self) -> str:
        parts = [self.what]
        if self.found:
            parts.append(f"found: {self.found}")
        if self.hint:
            parts.append(f"HINT: {self.hint}")
        return " | ".join(parts)


@dataclass(frozen=True)
class Problem:
    """One problem in a spec, located by its TOML path (``train.max_steps``) and, for parse errors, line."""

    path: str
    what: str
    found: str = ""
    hint: str = ""
    line: int | None = None

    def render(self) -> str:
        where = self.path or "(spec)"
        if self.line is not None:
            where += f" (line {self.line})"
        text = f"{where}: {self.what}"
        if self.found:
            text += f"; found {self.found}"
        if self.hint:
            text += f". HINT: {self.hint}"
        return text


class SpecError(SwiftSlurmError):
    """A spec that does not validate. Carries every problem found, not just the first."""

    exit_code = 2

    def __init__(self, source: str, problems: list[Problem]) -> None:
        self.source = source
        self.problems = list(problems)
        n = len(self.problems)
        super().__init__(
            f"{source}: {n} problem{'s' if n != 1 else ''} in the job spec",
            "; ".join(p.render() for p in self.problems),
            "fix the keys named above; `swiftslurm validate SPEC` re-checks",
        )


class OneScriptTooFew(SwiftSlurmError):
    """A valid spec that one standalone sbatch script cannot express (a sweep over several allocations)."""

    exit_code = 2


class SubmissionError(SwiftSlurmError):
    """Slurm (or the local executor) refused the submission."""

    exit_code = 3


class JobFailedError(SwiftSlurmError):
    exit_code = 1


class PreflightFailed(SwiftSlurmError):
    exit_code = 4


class CheckpointDamaged(SwiftSlurmError):
    exit_code = 5


class CheckpointUnreadable(SwiftSlurmError):
    """The ranks cannot agree on a checkpoint to resume from (one of them cannot read rank 0's choice)."""

    exit_code = 1


class ToolMissing(SwiftSlurmError):
    """An external tool (sbatch, nc, iperf3, fio, nvidia-smi) is not on PATH."""

    exit_code = 1


class RuntimeEnvError(SwiftSlurmError):
    """What Slurm granted does not match what the spec asked for (on-node)."""

    exit_code = 1
