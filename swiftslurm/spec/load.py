"""The job spec: TOML text to a typed, frozen ``JobSpec`` (models in ``model.py``).

Pure: ``parse_spec(text)`` and ``validate_spec(data)`` touch nothing outside their arguments.
``load_spec(path)`` reads the file; ``check_files(spec)`` is the one step that looks at the disk.
Every problem of a spec is collected and raised together as one ``SpecError``, each naming its TOML
path, what was found and what to do.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from ..errors import Problem, SpecError, did_you_mean
from ..fsutil import DIRECTORY, FILE, MISSING, UNREACHABLE, Unreadable, path_kind, read_bytes
from .model import (
    MAX_SPEC_BYTES,
    TINY_MODELS,
    FieldProblem,
    JobSpec,
    TrainTable,
    is_local_image,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


# ---------------------------------------------------------------- loading


def table_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a table field: ``T`` for ``T`` or for an optional table ``T | None``; else None."""
    import typing

    candidates = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    if len(candidates) == 1 and isinstance(candidates[0], type) and issubclass(candidates[0], BaseModel):
        return candidates[0]
    return None


def _model_at(path: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] = JobSpec
    for part in path:
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        sub = table_model(field.annotation)
        if sub is None:
            return None
        model = sub
    return model


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _problems_from(err: ValidationError, prefix: str = "") -> list[Problem]:
    problems = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        # pydantic adds union/type tags to locations; keep only real keys and indices
        loc = tuple(p for p in loc if not (isinstance(p, str) and ("[" in p or p in {"str", "list[str]"})))
        path = prefix + ".".join(str(p) for p in loc)
        kind = e["type"]
        if kind == "extra_forbidden":
            parent = _model_at(loc[:-1])
            valid = sorted(parent.model_fields) if parent else []
            hint = did_you_mean(str(loc[-1]), valid)
            hint = (hint + " " if hint else "") + (f"valid keys: {', '.join(valid)}" if valid else "")
            problems.append(Problem(path, "unknown key", hint=hint))
            continue
        keyed = (e.get("ctx") or {}).get("error")
        if isinstance(keyed, FieldProblem):  # a validator's refusal of one entry: its own key, found and hint
            problems.append(Problem(f"{path}.{keyed.key}" if path else keyed.key, keyed.what, keyed.found, keyed.hint))
            continue
        msg = e["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        found = "" if kind == "missing" else _describe(e.get("input"))
        if kind.endswith("_type") or kind.endswith("_parsing"):
            msg = "wrong type: " + msg[0].lower() + msg[1:]
        problems.append(Problem(path, msg, found, _hint_for(kind, loc, msg)))
    return problems


_TYPE_HINTS = {
    "int": "an integer without quotes, e.g. 2",
    "float": "a number without quotes, e.g. 1e-4",
    "bool": "true or false, without quotes",
    "string": "a quoted string",
    "list": "a TOML list, e.g. [\"a\", \"b\"]",
    "dict": "a TOML table",
    "model": "a TOML table, e.g. [train]",
}


def _default_of(loc: tuple) -> str:
    model = _model_at(loc[:-1]) if loc else None
    field = model.model_fields.get(str(loc[-1])) if model is not None and loc else None
    if field is None:
        return ""
    if table_model(field.annotation) is not None:
        return ""
    try:
        default = field.get_default(call_default_factory=True)
    except Exception:  # a default that does not validate alone (tables with required keys)
        return ""
    return f"remove the key to use the default ({default!r})" if default is not None else ""


def _hint_for(kind: str, loc: tuple, msg: str) -> str:
    """What to do about one pydantic error: the expected form, and the default where there is one."""
    if "HINT: " in msg:
        return ""  # the validator's own message carries the hint
    for prefix, text in _TYPE_HINTS.items():
        if kind.startswith(prefix + "_") and (kind.endswith("_type") or kind.endswith("_parsing")):
            default = _default_of(loc)
            return text + (f"; {default}" if default else "")
    if kind == "missing":
        return "add this key"
    if kind == "literal_error":
        return "use one of the values listed"
    default = _default_of(loc)
    return default or "see the spec reference in the README"


def parse_toml(text: str, source: str = "spec") -> dict[str, Any]:
    """TOML text to a dict; a parse error becomes a SpecError naming the line. A UTF-8 byte-order mark (what an editor
    saving "UTF-8 with BOM" writes first) is not part of the TOML: it is read past, not reported against line 1."""
    text = text.removeprefix("\ufeff")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        msg = str(exc)
        m = re.search(r"line (\d+)", msg)
        line = int(m.group(1)) if m else None
        return_problem = Problem("", f"not valid TOML: {msg}", line=line, hint="check the quoting and brackets on that line")
        raise SpecError(source, [return_problem]) from None
    except RecursionError:  # tomllib descends recursively into nested arrays and inline tables
        raise SpecError(source, [Problem("", "the TOML nests arrays or inline tables too deeply to read", "thousands of levels",
                                         "a job spec nests a few levels; check for a runaway '[' or '{'")]) from None


def _sweep_overrides(sweep: dict[str, list[Any]]) -> list[dict[str, Any]]:
    import itertools

    keys = list(sweep)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(sweep[k] for k in keys))]


def sweep_key_path(key: str) -> tuple[str, str]:
    """A sweep key names a train key (``learning_rate``) or a dotted ``table.key``."""
    if "." in key:
        table, _, field = key.partition(".")
        return table, field
    return "train", key


SWEEPABLE_TABLES = ("train", "slurm", "checkpoint", "preflight", "parallel")


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of the raw spec dict with sweep overrides applied and [sweep] removed."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items() if k != "sweep"}
    for key, value in overrides.items():
        table, field = sweep_key_path(key)
        out.setdefault(table, {})
        out[table] = {**out[table], field: value}
    return out


def validate_spec(data: dict[str, Any], source: str = "spec") -> JobSpec:
    """A raw dict (from TOML) to a JobSpec, or a SpecError with every problem found."""
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        problems = _problems_from(exc)
        problems += _sweep_problems(data, skip_values=True)
        raise SpecError(source, problems) from None
    problems = _sweep_problems(data, skip_values=False)
    if problems:
        raise SpecError(source, problems)
    return spec


def _sweep_problems(data: dict[str, Any], skip_values: bool) -> list[Problem]:
    sweep = data.get("sweep")
    if not isinstance(sweep, dict):
        return []
    problems: list[Problem] = []
    good: dict[str, list[Any]] = {}
    for key, values in sweep.items():
        table, field = sweep_key_path(key)
        model = _model_at((table,)) if table in SWEEPABLE_TABLES else None
        if model is None or field not in model.model_fields:
            valid = sorted(TrainTable.model_fields) if model is None or table == "train" else sorted(model.model_fields)
            hint = did_you_mean(field, valid) or f"sweep keys name a [train] key or 'table.key' ({', '.join(SWEEPABLE_TABLES)})"
            problems.append(Problem(f"sweep.{key}", "sweeps over a key that does not exist", hint=hint))
        elif isinstance(values, list) and values:
            good[key] = values
    if problems or skip_values or not good:
        return problems
    n = 1
    for values in good.values():
        n *= len(values)
    if n > 10000:
        return [Problem("sweep", f"the sweep has {n} combinations", hint="Slurm arrays above 10000 tasks are refused on most clusters; split the sweep")]
    for index, overrides in enumerate(_sweep_overrides(good)):
        try:
            JobSpec.model_validate(apply_overrides(data, overrides))
        except ValidationError as exc:
            for p in _problems_from(exc):
                problems.append(Problem(p.path, f"{p.what} (sweep task {index}: {overrides})", p.found, p.hint))
            break  # one failing combination says enough
    return problems


EMPTY_SPEC = "empty spec: nothing to run; a preflight-only spec names [preflight]"


def parse_spec(text: str, source: str = "spec") -> JobSpec:
    """TOML text to a JobSpec. A text without a single key (empty, blank, comments only) is refused: every
    default would make it a preflight-only job that nobody asked for."""
    data = parse_toml(text, source)
    if not data:
        found = "an empty file" if not text.strip() else "only blank lines and comments"
        raise SpecError(source, [Problem("", EMPTY_SPEC, found, "start from examples/quickstart.toml (training) or "
                                         "examples/preflight_only.toml (a preflight-only run)")])
    return validate_spec(data, source)


def load_spec(path: str | os.PathLike[str]) -> JobSpec:
    """Read and validate a spec file. A missing or unreadable file is a SpecError too."""
    p = Path(path)
    source = str(path)
    kind = path_kind(p)
    if kind == DIRECTORY:
        raise SpecError(source, [Problem("", "the spec path is a directory", source, "pass the .toml file itself")])
    if kind.startswith(UNREACHABLE):
        raise SpecError(source, [Problem("", "cannot read the spec file", f"{source}: {kind}",
                                         "check the path (each name at most 255 bytes) and its permissions")])
    try:  # a regular file under the cap: a FIFO or a device in the spec's place never blocks validate
        raw = read_bytes(p, MAX_SPEC_BYTES)
    except FileNotFoundError:
        raise SpecError(source, [Problem("", "no such spec file", source, "check the path; examples/quickstart.toml is a starting point")]) from None
    except Unreadable as exc:
        what = "the spec file is too large" if "cap for this kind of file" in exc.why else "cannot read the spec file"
        raise SpecError(source, [Problem("", what, exc.why,
                                         "pass a TOML file of a few KB (a job spec); check the path and its permissions")]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise SpecError(source, [Problem("", "the spec file is not UTF-8 text", f"byte {exc.start}", "save the spec as UTF-8 TOML", line=line)]) from None
    return parse_spec(text, source)


def load_raw(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The raw dict of a spec file (for planning sweeps). Call after load_spec succeeded."""
    return parse_toml(read_bytes(path, MAX_SPEC_BYTES).decode("utf-8"), str(path))


NO_TRAIN_NOTE = "no [train] table: a spec for `swiftslurm preflight` only; submit and render need [train] (model and dataset, or command)"


def require_training(spec: JobSpec, source: str = "spec") -> None:
    """``submit`` and ``render`` train: a spec without [train] (a preflight-only spec) is a SpecError there."""
    if not spec.has_training:
        raise SpecError(source, [Problem(
            "train", "the spec has no [train] table, so there is nothing to train", "a preflight-only spec",
            "add [train] with model and dataset (or command = [...] for your own script); "
            "`swiftslurm preflight SPEC` runs this spec as it is",
        )])


def check_files(spec: JobSpec, base: Path | None = None, source: str = "spec") -> None:
    """The disk-facing checks: datasets and a user DeepSpeed JSON exist and are readable."""
    from .. import dsconfig

    base = base or Path.cwd()
    problems: list[Problem] = []

    def look(field: str, name: str, want: tuple[str, ...], missing: str, hint: str) -> None:
        """A problem at ``field`` unless the path ``name`` (relative to ``base``) is one of ``want``."""
        p = Path(name) if Path(name).is_absolute() else base / name
        kind = path_kind(p)
        if kind not in want:
            problems.append(Problem(field, missing if kind == MISSING else f"{missing.replace(' not found', '')} cannot be used",
                                    str(p) if kind == MISSING else f"{p}: {kind}", hint))

    here = "paths are relative to the directory you run swiftslurm from"
    out = Path(spec.job.output_dir) if Path(spec.job.output_dir).is_absolute() else base / spec.job.output_dir
    missing = out
    while (kind := path_kind(missing)) == MISSING and missing != missing.parent:
        missing = missing.parent  # the nearest part that exists: where the output dir would be made
    if kind != DIRECTORY:  # a file at (or above) the output dir, or a path that cannot be looked at
        problems.append(Problem("job.output_dir", "the output dir cannot be made there", f"{missing}: {kind}",
                                "pick another path: the output dir and each dir above it must be directories or not exist yet"))
    elif missing != out and not os.access(missing, os.W_OK | os.X_OK):
        problems.append(Problem("job.output_dir", "the output dir cannot be made there", f"{missing} is not writable by you",
                                "pick a directory you can write (on the shared filesystem every node mounts)"))
    for i, ds in enumerate(spec.train.dataset):  # a directory: datasets' save_to_disk (its layout is checked by the scan)
        look(f"train.dataset[{i}]", ds, (FILE, DIRECTORY), "dataset file not found", here)
    for i, ds in enumerate(spec.train.eval_dataset):
        look(f"train.eval_dataset[{i}]", ds, (FILE, DIRECTORY), "eval dataset file not found", here)
    model = spec.train.model
    if model and model not in TINY_MODELS and (model.startswith((".", "/")) or path_kind(model) != MISSING):
        look("train.model", model, (DIRECTORY,), "local model directory not found",
             "a hub id like 'Qwen/Qwen2.5-7B-Instruct' or a directory with config.json")
    if spec.train.resume_from is not None:
        look("train.resume_from", spec.train.resume_from, (DIRECTORY,), "checkpoint directory not found",
             "a checkpoint-N directory of another run (or that run's output dir: its newest verified checkpoint), an HF "
             "Trainer checkpoint-N, a model or a peft adapter directory; relative paths start from the directory you run "
             "swiftslurm from")
    ds = spec.train.deepspeed
    if ds.endswith(".json") or "/" in ds:
        p = Path(ds) if Path(ds).is_absolute() else base / ds
        try:
            dsconfig.load_user_config(p)
        except SpecError as exc:
            problems += exc.problems
    if spec.container is not None and is_local_image(spec.container.image):
        look("container.image", spec.container.image, (FILE,), f"local {spec.container.runtime} image not found",
             "build or copy the image there (every node reads it), or name a registry image")
    if problems:
        raise SpecError(source, problems)
