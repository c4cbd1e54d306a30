"""The reward functions of ``task = "grpo"``: the built-ins, the user's own, and the guard every one runs in.

TRL calls each function as ``f(prompts, completions, completion_ids, **columns)`` (the dataset's other columns as
lists, one entry per completion) and takes one float per completion. ``train.reward_funcs`` names them:

- ``length``: 1.0 at ``reward_length_target`` completion tokens, falling linearly to 0 at twice or zero that;
- ``format``: 1.0 when the completion matches ``reward_format_regex`` in full (``re.DOTALL``), else 0.0;
- ``accuracy``: 1.0 when the completion, or its last word, equals the record's ``solution`` (case and surrounding
  whitespace and punctuation ignored), else 0.0;
- ``file.py:function``: a function in a Python file (made absolute against the spec's directory by ``plan``); its
  directory goes first on ``sys.path``, so it may import its siblings;
- ``module:function``: a function of a module importable on the nodes.

The user's code runs on every rank, in the rank's process: it is the user's own, as ``train.command`` is.

``Guarded`` wraps each: an exception (or a reward count that does not match) is recorded with the function, the
sample and the exception, and the function answers NaN, so the rank reaches TRL's gather of the rewards like every
other rank. ``agree_on_failure`` then decides at one collective whether any rank failed; every rank raises the
same ``RewardFailed`` (the lowest failing rank's record), so none is left waiting in the next collective.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ...errors import SwiftSlurmError
from ...spec.grpo_rules import FILE_REWARD_RE, USER_REWARD_RE

REWARD_FAILED_EXIT = 70  # sysexits' EX_SOFTWARE, as 75 (the walltime stop) is EX_TEMPFAIL: the user's code failed
SAMPLE_CHARS = 160


class RewardFailed(SwiftSlurmError):
    """A reward function raised on some rank: every rank raises this, with that rank's record."""

    exit_code = REWARD_FAILED_EXIT
    agreed = True  # one verdict, raised alike on every rank: they leave the process group together


class RewardUnavailable(SwiftSlurmError):
    """A ``module:function`` or ``file.py:function`` that cannot be imported on this node."""

    exit_code = 2


# ---------------------------------------------------------------- the built-ins (pure)


def completion_text(completion: Any) -> str:
    """A completion's text: the string itself, or the content of a conversational completion's messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def length_reward(target: int) -> Callable[..., list[float]]:
    def length(prompts, completions, completion_ids=None, **_: Any) -> list[float]:
        counts = [len(ids) for ids in completion_ids] if completion_ids is not None else [len(completion_text(c)) for c in completions]
        return [max(0.0, 1.0 - abs(n - target) / target) for n in counts]

    return length


def format_reward(regex: str) -> Callable[..., list[float]]:
    pattern = re.compile(regex, re.DOTALL)

    def format(prompts, completions, **_: Any) -> list[float]:  # the name TRL logs: rewards/format/mean
        return [1.0 if pattern.fullmatch(completion_text(c).strip()) else 0.0 for c in completions]

    return format


def _norm(text: str) -> str:
    return " ".join(str(text).split()).strip(" .,;:!?\"'").lower()


def accuracy(prompts, completions, solution=None, **_: Any) -> list[float]:
    if solution is None:  # validate refuses a dataset without it; a record may still hold None
        raise ValueError("the built-in 'accuracy' needs a 'solution' column in the dataset")
    out = []
    for c, want in zip(completions, solution, strict=True):
        text, goal = _norm(completion_text(c)), _norm(want)
        words = text.split()
        out.append(1.0 if goal and (text == goal or (words and _norm(words[-1]) == goal)) else 0.0)
    return out


# ---------------------------------------------------------------- resolving names


def _user_function(name: str) -> Callable[..., Any]:
    file_form = FILE_REWARD_RE.fullmatch(name)
    try:
        if file_form:
            path = Path(file_form.group(1))
            if str(path.parent) not in sys.path:
                sys.path.insert(0, str(path.parent))  # the file may import its siblings
            # named by its resolved path: a/score.py and b/score.py are two modules (by the stem alone the second name
            # found the first's module, and ran a/score.py's function for both)
            module_name = f"swiftslurm_reward_{path.stem}_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]}"
            module = sys.modules.get(module_name)
            if module is None:
                spec = importlib.util.spec_from_file_location(module_name, path)
                if spec is None or spec.loader is None:
                    raise ImportError(f"not a Python file: {path}")
                module = importlib.util.module_from_spec(spec)
                sys.modules[module_name] = module
                spec.loader.exec_module(module)
            func_name = file_form.group(2)
        else:
            match = USER_REWARD_RE.fullmatch(name)
            if match is None:  # validate checked the form
                raise ImportError(f"{name!r} is not module:function")
            module = importlib.import_module(match.group(1))
            func_name = match.group(2)
        func = getattr(module, func_name)
    except (ImportError, OSError, AttributeError, SyntaxError) as exc:
        raise RewardUnavailable(f"cannot load the reward function {name!r} on this node", f"{type(exc).__name__}: {exc}",
                                "a file.py:function is found next to the spec; a module:function must be importable "
                                "with the nodes' Python (installed, or on PYTHONPATH via [env])") from None
    if not callable(func):
        raise RewardUnavailable(f"the reward function {name!r} is not callable", type(func).__name__,
                                "name a function f(prompts, completions, **columns) -> list[float]")
    return func


def resolve(train) -> list[tuple[str, Callable[..., Any]]]:
    """(name, function) of each ``train.reward_funcs`` entry, in order."""
    out = []
    for name in train.reward_funcs:
        if name == "length":
            out.append((name, length_reward(train.reward_length_target)))
        elif name == "format":
            out.append((name, format_reward(train.reward_format_regex)))
        elif name == "accuracy":
            out.append((name, accuracy))
        else:
            out.append((name, _user_function(name)))
    return out


# ---------------------------------------------------------------- the guard


@dataclass(frozen=True)
class RewardFailure:
    """Which function failed on which sample, and how: plain data, gathered to every rank."""

    function: str
    rank: int
    sample: str  # the prompt and completion, cut short
    error: str  # "ValueError: ..."

    def message(self) -> str:
        return f"reward function {self.function!r} raised on rank {self.rank}: {self.error}"


def _sample(prompts: list[Any], completions: list[Any], index: int) -> str:
    def cut(value: Any) -> str:
        text = " ".join(completion_text(value).split())
        return text if len(text) <= SAMPLE_CHARS else text[:SAMPLE_CHARS - 3] + "..."

    if not prompts or index >= len(prompts):
        return f"batch of {len(prompts)}"
    return f"sample {index}: prompt {cut(prompts[index])!r}, completion {cut(completions[index])!r}"


class Guarded:
    """A reward function that never raises into TRL: a failure is recorded (``failures``) and answered with NaN."""

    def __init__(self, name: str, func: Callable[..., Any], rank: int, failures: list[RewardFailure]):
        self.name, self.func, self.rank, self.failures = name, func, rank, failures
        self.__name__ = name if FILE_REWARD_RE.fullmatch(name) is None else f"{Path(name.rsplit(':', 1)[0]).stem}:{name.rsplit(':', 1)[1]}"

    def __call__(self, prompts, completions, **kwargs: Any) -> list[float]:
        nan = [math.nan] * len(prompts)
        try:
            out = list(self.func(prompts=prompts, completions=completions, **kwargs))
        except Exception as exc:
            self.failures.append(RewardFailure(self.name, self.rank, self._where(prompts, completions, kwargs, exc),
                                               f"{type(exc).__name__}: {exc}"[:600]))
            return nan
        if len(out) != len(prompts):
            self.failures.append(RewardFailure(self.name, self.rank, f"batch of {len(prompts)}",
                                               f"returned {len(out)} rewards for {len(prompts)} completions"))
            return nan
        scores = []
        for i, r in enumerate(out):  # a value that is no number fails the same agreed way as a raise, on every rank
            try:
                scores.append(math.nan if r is None else float(r))
            except (TypeError, ValueError, OverflowError):
                self.failures.append(RewardFailure(self.name, self.rank, _sample(prompts, completions, i),
                                                   f"returned {type(r).__name__} {str(r)[:100]!r}, not a number"))
                return nan
        return scores

    def _where(self, prompts, completions, kwargs: dict[str, Any], exc: Exception) -> str:
        """The sample that raised: found by calling the function on one completion at a time (cheap; it failed once)."""
        for i in range(len(prompts)):
            one = {k: (v[i : i + 1] if isinstance(v, list) and len(v) == len(prompts) else v) for k, v in kwargs.items()}
            try:
                self.func(prompts=prompts[i : i + 1], completions=completions[i : i + 1], **one)
            except Exception:
                return _sample(prompts, completions, i)
        return _sample(prompts, completions, len(prompts))  # it fails on the batch only


def guard(named: list[tuple[str, Callable[..., Any]]], rank: int, failures: list[RewardFailure]) -> list[Guarded]:
    """Each function guarded; names TRL logs its metrics under (``rewards/<name>/mean``) made unique: two files' ``score``
    are told apart by their directories."""
    guarded = [Guarded(name, func, rank, failures) for name, func in named]
    shown = [g.__name__ for g in guarded]
    for g in guarded:
        if shown.count(g.__name__) > 1 and FILE_REWARD_RE.fullmatch(g.name):
            file, func = g.name.rsplit(":", 1)
            g.__name__ = f"{Path(file).parent.name}/{Path(file).stem}:{func}"
    return guarded


def agree_on_failure(failures: list[RewardFailure], device) -> RewardFailure | None:
    """One verdict for every rank (two collectives, every rank calls it after each scoring): the lowest failing
    rank's first record, or None when no rank failed."""
    import torch
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
        return failures[0] if failures else None
    flag = torch.tensor([1.0 if failures else 0.0], device=device)
    tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
    if flag.item() == 0:
        return None
    everyone: list[Any] = [None] * tdist.get_world_size()
    tdist.all_gather_object(everyone, failures[0].__dict__ if failures else None)
    first = next(f for f in everyone if f is not None)
    return RewardFailure(**first)


def failed_error(failure: RewardFailure) -> RewardFailed:
    return RewardFailed(failure.message(), failure.sample,
                        f"fix the function (exit code {REWARD_FAILED_EXIT}: a reward function failed); it is called as "
                        "f(prompts, completions, completion_ids, **columns) and returns one float (or None) per completion")

