"""Cross-field rules of [train] for online RL (``task = "grpo"``): the reward functions and their parameters,
the generation keys, and the batch that must hold whole groups of completions.

Pure: each rule looks at a validated ``TrainTable`` (or its world size) and returns messages with the domain
reason and the alternative; ``TrainTable._cross`` and ``JobSpec`` raise the first. Nothing here imports a
reward module: a ``module:function`` or ``file.py:function`` name is checked for its form only (the user's code
is imported on the ranks: train/tasks/rewards.py; ``validate`` checks that a file exists: jobs/prepare.py).
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import did_you_mean
from .train_fields import TINY_MODELS

# the reward functions swiftslurm ships (train/tasks/rewards.py) and the key each one needs
BUILTIN_REWARDS = {"length": "reward_length_target", "format": "reward_format_regex", "accuracy": None}
GRPO_KEYS = ("reward_funcs", "reward_weights", "reward_length_target", "reward_format_regex", "num_generations",
             "max_completion_length", "temperature", "grpo_beta", "use_vllm")
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
USER_REWARD_RE = re.compile(rf"({_IDENT}(?:\.{_IDENT})*):({_IDENT})")  # an importable module
FILE_REWARD_RE = re.compile(rf"([^:\x00-\x1f\x7f]+\.py):({_IDENT})")  # a Python file, relative to the spec's directory
REWARD_FORM = ('a built-in (length, format, accuracy), "file.py:function" (a file next to the spec, or a path '
               'relative to it) or "module:function" (a module importable on the nodes)')


def resolve_reward_file(name: str, spec_dir: str) -> str:
    """``file.py:function`` with the file's path made absolute against the spec's directory; any other name as is."""
    import posixpath

    m = FILE_REWARD_RE.fullmatch(name)
    if not m or posixpath.isabs(m.group(1)):
        return name
    return f"{posixpath.normpath(posixpath.join(spec_dir, m.group(1)))}:{m.group(2)}"


def reward_definition_problem(source: str, func: str) -> tuple[str, str] | None:
    """Why the Python ``source`` of a reward file cannot give a function ``func`` (what, found), or None (pure: the
    file is parsed, nothing of it runs). Bindings it cannot judge without running it (an import, a call, a name bound
    to another name, a decorated def) pass: the rank that imports it says more."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return "the reward function's file has a syntax error", f"line {exc.lineno}: {exc.msg}"
    except ValueError as exc:  # a NUL byte
        return "the reward function's file is not Python source", str(exc)
    top: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            top[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    top[target.id] = node.value if node.value is not None else node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                top[alias.asname or alias.name.split(".")[0]] = node
    found = top.get(func)
    if found is None:
        defined = sorted(name for name, n in top.items() if isinstance(n, (ast.FunctionDef, ast.Lambda)))
        close = did_you_mean(func, defined)
        return (f"the reward function's file defines no {func!r}",
                (f"its top-level functions: {', '.join(defined[:8])}" if defined else "no top-level function") + (f"; {close}" if close else ""))
    if isinstance(found, ast.AsyncFunctionDef):
        return f"the reward function {func!r} is a coroutine (async def)", "TRL calls reward functions synchronously"
    if isinstance(found, (ast.Constant, ast.List, ast.Tuple, ast.Dict, ast.Set, ast.JoinedStr, ast.ListComp, ast.DictComp)):
        return f"{func!r} in the reward function's file is not a function", f"it is bound to a {type(found).__name__.lower()}"
    return None


def _changed(t: Any, keys: tuple[str, ...]) -> list[str]:
    """The keys whose value is not the default (a spec read back from a plan file has every key set)."""
    fields = type(t).model_fields
    return [k for k in keys if getattr(t, k) != (fields[k].default_factory() if fields[k].default_factory else fields[k].default)]


def reward_name_problem(name: str) -> str | None:
    """Why ``name`` is not a reward function name, or None."""
    if name in BUILTIN_REWARDS or USER_REWARD_RE.fullmatch(name) or FILE_REWARD_RE.fullmatch(name):
        return None
    close = did_you_mean(name, BUILTIN_REWARDS)
    return f"reward_funcs entry {name!r} is not {REWARD_FORM}{'; ' + close if close else ''}"


def grpo_problems(t: Any) -> list[str]:
    """Every cross-field problem of the GRPO keys of a [train] table."""
    if t.task != "grpo":
        keys = _changed(t, GRPO_KEYS)
        return [f"{', '.join(keys)} set with task = {t.task!r}: these keys configure online RL only. HINT: set "
                "task = \"grpo\", or drop them"] if keys else []
    out: list[str] = []
    if not t.reward_funcs and not t.command:
        out.append("task = \"grpo\" needs train.reward_funcs: what scores each completion. HINT: e.g. reward_funcs = "
                   "[\"length\"] with reward_length_target = 64, or [\"mymodule:score\"] for a function in mymodule.py "
                   "next to the spec")
    out += [p for p in map(reward_name_problem, t.reward_funcs) if p]
    if len(set(t.reward_funcs)) != len(t.reward_funcs):
        out.append(f"reward_funcs names a function twice: {t.reward_funcs}. HINT: give it a larger reward_weights entry instead")
    if t.reward_weights is not None and len(t.reward_weights) != len(t.reward_funcs):
        out.append(f"reward_weights has {len(t.reward_weights)} entries for {len(t.reward_funcs)} reward_funcs: one weight "
                   "per function, in the same order. HINT: drop reward_weights (every weight 1.0) or give one per function")
    for builtin, key in BUILTIN_REWARDS.items():
        if key is None:
            continue
        if builtin in t.reward_funcs and getattr(t, key) is None:
            out.append(f"the built-in reward {builtin!r} needs train.{key}. HINT: "
                       + ("the completion length in tokens that scores 1.0, e.g. 64" if builtin == "length"
                          else "a regular expression a good completion matches in full, e.g. \"<answer>.*</answer>\""))
        elif builtin not in t.reward_funcs and getattr(t, key) is not None:
            out.append(f"train.{key} is set but reward_funcs has no {builtin!r}: only that built-in reads it. HINT: add "
                       f"{builtin!r} to reward_funcs, or drop {key}")
    if t.reward_format_regex is not None:
        try:
            re.compile(t.reward_format_regex)
        except re.error as exc:
            out.append(f"reward_format_regex is not a regular expression Python compiles ({exc}); found "
                       f"{t.reward_format_regex!r}. HINT: escape literal brackets and dots with a backslash")
    if t.max_completion_length >= t.max_length:
        out.append(f"max_completion_length ({t.max_completion_length}) must be below max_length ({t.max_length}): the "
                   "prompt and its completion share max_length (the model's context). HINT: e.g. max_completion_length "
                   "= max_length / 2")
    dpo = _changed(t, ("dpo_beta", "dpo_loss_type", "precompute_ref_log_probs", "max_prompt_length"))
    if dpo:
        out.append(f"{', '.join(dpo)} set with task = \"grpo\": these keys configure DPO. HINT: GRPO's KL weight is "
                   "grpo_beta; drop them")
    if t.use_liger_kernel is True:
        out.append("use_liger_kernel = true with task = \"grpo\": TRL's GRPOTrainer scores completions with its own "
                   "log-probability pass; Liger's fused loss was measured for SFT only. HINT: drop use_liger_kernel "
                   "(\"auto\" leaves it off for GRPO)")
    if t.model in TINY_MODELS and t.train_type == "full" and t.grpo_beta > 0:
        out.append(f"grpo_beta > 0 with train_type = \"full\" and model = \"{t.model}\": TRL loads the reference model "
                   "from the model's path, and the built-in test model has none. HINT: train_type = \"lora\" (the "
                   "reference is the adapter switched off), or grpo_beta = 0")
    if t.resume_weights_only and t.train_type == "lora":
        out.append("train.resume_weights_only with task = \"grpo\" and train_type = \"lora\" is not supported (TRL wraps "
                   "the adapter itself): merge the adapter into a model dir and set train.model to it, or resume fully")
    return out


def generation_batch_problem(t: Any, world_size: int, parallel: Any) -> str | None:
    """GRPO compares the completions of one prompt with each other: the generation batch (micro-batch x ranks x
    accumulation steps) must hold whole groups of ``num_generations``. None when it does (or for other tasks)."""
    if t.task != "grpo":
        return None
    if parallel.sequence_parallel > 1 or parallel.tensor_parallel > 1:
        return ("[parallel] with task = \"grpo\": TRL's GRPOTrainer builds its inputs after generation, so neither "
                "sequence nor tensor parallel can shard them. HINT: drop [parallel] (ZeRO-3 shards the weights)")
    batch = t.per_device_train_batch_size * world_size * t.gradient_accumulation_steps
    if batch % t.num_generations == 0:
        return None
    fits = [n for n in range(2, batch + 1) if batch % n == 0]
    return (f"train.num_generations ({t.num_generations}) must divide the generation batch: per_device_train_batch_size "
            f"({t.per_device_train_batch_size}) x world size ({world_size}) x gradient_accumulation_steps "
            f"({t.gradient_accumulation_steps}) = {batch} completions, scored in groups of one prompt's generations. "
            f"HINT: num_generations = {fits[-1] if fits else 2}"
            + ("" if fits else ", with per_device_train_batch_size = 2"))
