"""DeepSpeed presets and the rules of SPEC.md: spec + world size -> the final DeepSpeed dict.

Pure, apart from reading the preset JSON files shipped in ``swiftslurm.ds_config`` (found by ``resources.resource_dir``) and a user's JSON
file in ``load_user_config``. ``build_for_spec`` does, in order:

1. start from the preset named by ``train.deepspeed`` (or the user's JSON file);
2. deep-merge the spec's ``[deepspeed]`` table over it;
3. validate the merged config (stage, offload combinations); refusals raise ``SpecError``
   with a Problem naming the TOML path and a domain reason;
4. drop ``optimizer`` (with a warning: the trainer owns the optimizer) and swiftslurm's own keys;
5. inject the batch sizes, precision and the fixed keys of SPEC.md.

Both offloads (``offload_optimizer`` and ``offload_param``) on at once are refused unless the config
says ``"swiftslurm_allow_both_offloads": true`` (the ``zero3_offload`` and ``zero3_nvme`` presets do;
a user sets it in ``[deepspeed]`` or in the JSON file). The key is removed before DeepSpeed sees it.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any, Mapping, Protocol

from .errors import Problem, SpecError
from .fsutil import CONFIG_CAP, Unreadable, read_text
from .resources import resource_dir


# What the DeepSpeed config reads of the job spec, as read-only protocols (``spec.model.JobSpec`` satisfies
# ``SpecView``): this module sits below ``spec`` and imports none of it; the type checker holds the two together.
class TrainView(Protocol):
    @property
    def deepspeed(self) -> str: ...
    @property
    def bf16(self) -> bool: ...
    @property
    def fp16(self) -> bool: ...
    @property
    def per_device_train_batch_size(self) -> int: ...
    @property
    def gradient_accumulation_steps(self) -> int: ...


class ParallelView(Protocol):
    @property
    def sequence_parallel(self) -> int: ...
    @property
    def tensor_parallel(self) -> int: ...
    @property
    def expert(self) -> int: ...


class SpecView(Protocol):
    @property
    def train(self) -> TrainView: ...
    @property
    def deepspeed(self) -> Mapping[str, Any]: ...
    @property
    def parallel(self) -> ParallelView: ...
    @property
    def world_size(self) -> int: ...

ALLOW_BOTH_OFFLOADS = "swiftslurm_allow_both_offloads"
OFFLOAD_DEVICES = ("cpu", "nvme")
MAX_NESTING = 32  # deeper than any DeepSpeed config; shallow enough for the recursive merge


def _refuse_constant(name: str) -> Any:
    raise json.JSONDecodeError(f"{name} is not a number DeepSpeed can use (JSON has no NaN or Infinity)", name, 0)


def nesting_depth(value: Any) -> int:
    """How deep lists and dicts nest in ``value`` (0 for a scalar); iterative, so any depth is safe."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            stack += [(v, depth + 1) for v in item.values()]
        elif isinstance(item, list):
            stack += [(v, depth + 1) for v in item]
    return deepest


def preset_names() -> list[str]:
    root = resource_dir("ds_config")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def is_user_file(name: str) -> bool:
    """``train.deepspeed`` names a user JSON file (not a preset)."""
    return name.endswith(".json") or "/" in name


def load_preset(name: str) -> dict[str, Any]:
    text = resource_dir("ds_config").joinpath(f"{name}.json").read_text("utf-8")
    return json.loads(text)


def _refuse(path: str, what: str, found: Any = "", hint: str = "", source: str = "deepspeed") -> SpecError:
    return SpecError(source, [Problem(path, what, "" if found == "" else repr(found), hint)])


def load_user_config(path: str | Path) -> dict[str, Any]:
    """Read and validate a user's DeepSpeed JSON. Problems are reported under ``train.deepspeed``."""
    source = str(path)
    try:  # a regular file under its cap (a FIFO named in the spec would hang validate)
        text = read_text(path, CONFIG_CAP)
    except FileNotFoundError:
        raise _refuse("train.deepspeed", "DeepSpeed config file not found", source,
                      f"a preset ({', '.join(preset_names())}) or a path to an existing .json file", source) from None
    except (OSError, ValueError) as exc:
        raise _refuse("train.deepspeed", "cannot read the DeepSpeed config file", f"{source}: {exc.why if isinstance(exc, Unreadable) else exc}",
                      "check the path and its permissions", source) from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
        too_deep = nesting_depth(data) > MAX_NESTING
    except RecursionError:
        too_deep = True
    except json.JSONDecodeError as exc:
        raise SpecError(source, [Problem("train.deepspeed", f"not valid JSON: {exc.msg}", f"{source} line {exc.lineno}",
                                         "fix the JSON syntax (no comments or trailing commas)", line=exc.lineno)]) from None
    if too_deep:
        raise _refuse("train.deepspeed", f"the DeepSpeed config nests more than {MAX_NESTING} levels deep", source,
                      "a DeepSpeed config nests a few levels; start from a preset", source)
    if not isinstance(data, dict):
        raise _refuse("train.deepspeed", "a DeepSpeed config must be a JSON object", type(data).__name__,
                      'start from a preset, e.g. {"zero_optimization": {"stage": 2}}', source)
    stage = data.get("zero_optimization", {}).get("stage") if isinstance(data.get("zero_optimization"), dict) else None
    if stage not in (2, 3) or isinstance(stage, bool):
        raise _refuse("train.deepspeed", "a user DeepSpeed config must set zero_optimization.stage to 2 or 3",
                      stage if stage is not None else "no stage",
                      "stages 0 and 1 are available as the presets zero0/zero1", source)
    return data


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """A new dict: ``over`` merged into ``base``; nested dicts merge, everything else replaces."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _offload_device(zero: dict[str, Any], key: str) -> str | None:
    section = zero.get(key)
    if not isinstance(section, dict):
        return None
    device = section.get("device")
    return device if device in OFFLOAD_DEVICES else None


def validate(config: dict[str, Any], bf16: bool) -> list[Problem]:
    """Every refused combination in a merged config, as Problems located by ``deepspeed.*`` paths."""
    problems: list[Problem] = []
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        return [Problem("deepspeed.zero_optimization", "must be a table", type(zero).__name__)]
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        return [Problem("deepspeed.zero_optimization.stage", "unknown ZeRO stage", repr(stage),
                        "DeepSpeed ZeRO has stages 0, 1, 2 and 3")]
    opt_dev = _offload_device(zero, "offload_optimizer")
    param_dev = _offload_device(zero, "offload_param")
    if param_dev and stage != 3:
        problems.append(Problem("deepspeed.zero_optimization.offload_param",
                                "parameter offload needs ZeRO stage 3 (parameters are only partitioned in stage 3)",
                                f"stage {stage}", "use the zero3_offload preset or drop offload_param"))
    if opt_dev and stage == 0:
        problems.append(Problem("deepspeed.zero_optimization.offload_optimizer",
                                "optimizer offload needs ZeRO stage 1 or higher", "stage 0", "use zero2_offload"))
    for key, dev in (("offload_optimizer", opt_dev), ("offload_param", param_dev)):
        if dev != "nvme":
            continue
        if stage != 3:
            problems.append(Problem(f"deepspeed.zero_optimization.{key}", "NVMe offload needs ZeRO stage 3",
                                    f"stage {stage}", "use the zero3_nvme preset or device = \"cpu\""))
        if not bf16:
            problems.append(Problem(f"deepspeed.zero_optimization.{key}",
                                    "NVMe offload needs bf16 (swapping fp32 tensors doubles the NVMe traffic; "
                                    "DeepSpeed's NVMe path is only tested with bf16 here)",
                                    "train.bf16 = false", "set train.bf16 = true or offload to \"cpu\""))
    if opt_dev and param_dev and config.get(ALLOW_BOTH_OFFLOADS) is not True:
        problems.append(Problem("deepspeed.zero_optimization.offload_param",
                                "offload_optimizer and offload_param are both on: CPU memory must then hold "
                                "the parameters, gradients and optimizer state of every rank on the node",
                                f"offload_optimizer={opt_dev}, offload_param={param_dev}",
                                f"turn one off, use the zero3_offload preset, or set {ALLOW_BOTH_OFFLOADS} = true "
                                "in [deepspeed] if the nodes have the memory"))
    return problems


NVME_SWAP_PREFIX = "swiftslurm-"


def nvme_swap_name(job_id: str, task: int | None, output_dir: str) -> str:
    """The swap folder name of one job and task: ``swiftslurm-<job id>[-<array task>]-<8 hex of output_dir>``
    (pure). The job id separates jobs on a node, the output dir separates the tasks of one job (each has its
    own), even under the local executor, where sweep tasks may share a job id."""
    safe_id = "".join(c if c.isalnum() or c in "._-" else "_" for c in str(job_id)) or "job"
    task_part = f"-{task}" if task is not None else ""
    return f"{NVME_SWAP_PREFIX}{safe_id}{task_part}-{hashlib.sha1(output_dir.encode()).hexdigest()[:8]}"


def isolate_nvme_swap(config: dict[str, Any], name: str) -> tuple[dict[str, Any], list[str]]:
    """Pure: ``config`` with every NVMe offload's ``nvme_path`` moved to ``<nvme_path>/<name>``, and those folders.

    DeepSpeed empties ``<nvme_path>/zero_stage_3/.../rank<R>`` at start: two jobs (or sweep tasks) on one
    node with the same nvme_path would delete each other's swap files. Configs without NVMe offload come
    back unchanged (and no folders)."""
    out = copy.deepcopy(config)
    zero = out.get("zero_optimization")
    folders: list[str] = []
    if not isinstance(zero, dict):
        return out, folders
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key)
        if isinstance(section, dict) and section.get("device") == "nvme" and section.get("nvme_path"):
            folder = str(Path(str(section["nvme_path"])) / name)
            section["nvme_path"] = folder
            if folder not in folders:
                folders.append(folder)
    return out, folders


def _precision(spec_train: TrainView) -> dict[str, Any]:
    fp16: dict[str, Any] = {"enabled": bool(spec_train.fp16)}
    if spec_train.fp16:
        fp16.update({"loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                     "hysteresis": 2, "min_loss_scale": 1})
    return {"bf16": {"enabled": bool(spec_train.bf16)}, "fp16": fp16}


# Under every preset and user file (which, like [deepspeed], win): DeepSpeed's throughput timer (its samples/s log
# line, which swiftslurm does not read) synchronizes the device at each forward's start and each step's end by
# default, two host syncs per step that keep the CPU from queueing the next step while the GPU works. Unsynchronized
# it times the host instead (DeepSpeed's docs: "the CPU timer provides sufficient accuracy in many cases").
HOUSE_DEFAULTS: dict[str, Any] = {"timers": {"throughput": {"synchronized": False}}}


def build(base: dict[str, Any], overrides: dict[str, Any], spec_train: TrainView, world_size: int,
          source: str = "deepspeed", sequence_parallel: int = 1, tensor_parallel: int = 1,
          expert_parallel: int = 1) -> tuple[dict[str, Any], list[str]]:
    """The pure core: preset/user dict + [deepspeed] overrides + train settings -> (ds dict, warnings).

    ``train_batch_size`` is micro x accumulation x world size, the value HF Trainer requires of the config
    it is given. With sequence or tensor parallel the ranks of one group train on the same samples, and
    Accelerate/DeepSpeed count data-parallel ranks only (world / (sequence_parallel x tensor_parallel)):
    the plan shows that global batch (``sizing.layout``)."""
    merged = deep_merge(deep_merge(HOUSE_DEFAULTS, base), overrides)
    problems = validate(merged, bf16=bool(spec_train.bf16))
    if problems:
        raise SpecError(source, problems)
    warnings: list[str] = []
    optimizer = merged.pop("optimizer", None)
    if optimizer is not None:
        kind = optimizer.get("type") if isinstance(optimizer, dict) else optimizer
        warnings.append(f"deepspeed.optimizer (type {kind!r}) is ignored: the trainer owns the optimizer "
                        f"(AdamW with train.learning_rate and train.weight_decay)")
    merged.pop(ALLOW_BOTH_OFFLOADS, None)
    micro = spec_train.per_device_train_batch_size
    accum = spec_train.gradient_accumulation_steps
    if tensor_parallel > 1:  # AutoTP training: DeepSpeed splits the Linear layers across the TP group
        tp = merged.get("tensor_parallel")
        merged["tensor_parallel"] = deep_merge(tp if isinstance(tp, dict) else {}, {"autotp_size": tensor_parallel})
        merged.setdefault("zero_optimization", {})["gather_16bit_weights_on_model_save"] = True  # a whole HF model on save
    if sequence_parallel > 1:
        merged["sequence_parallel_size"] = sequence_parallel
    if expert_parallel > 1:  # AutoEP: DeepSpeed swaps each MoE layer for one holding 1/N of its experts (the preset from
        # the model's model_type; a [deepspeed] expert_parallel table may add preset_model or custom patterns)
        ep = merged.get("expert_parallel")
        merged["expert_parallel"] = deep_merge(ep if isinstance(ep, dict) else {}, {"enabled": True, "autoep_size": expert_parallel})
    merged.update({
        "train_batch_size": micro * world_size * accum,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    })
    for key, value in _precision(spec_train).items():
        merged[key] = deep_merge(merged.get(key, {}) if isinstance(merged.get(key), dict) else {}, value)
    return merged, warnings


def one_rank(preset: dict[str, Any], world_size: int) -> dict[str, Any]:
    """A preset as it runs on a single rank (pure): ZeRO-1/2 without ``contiguous_gradients``.

    With it, DeepSpeed's gradient hook copies every gradient into the reduce bucket as the backward makes it (a
    narrow and a copy per tensor, launched from the host while the GPU waits) so that each bucket reaches the
    reduce-scatter in one piece; a single rank reduces with nobody. Without it the hook books the gradient and the
    step reads it where autograd left it. On one H200 the 0.5B full fine-tune ran 1.20-1.22x faster without it
    (two interleaved rounds) at the same peak memory (docs/benchmarks.md, "Eighth run"). On several ranks it stays
    on: off, DeepSpeed reduces by all-reduce instead of reduce-scatter, twice the traffic. With the optimizer
    offloaded DeepSpeed keeps it on regardless, and stages 0 and 3 are left as they are. Only presets pass through
    this: a user's JSON file and the spec's ``[deepspeed]`` table keep what they say."""
    zero = preset.get("zero_optimization")
    if world_size != 1 or not isinstance(zero, dict) or zero.get("stage") not in (1, 2) \
            or _offload_device(zero, "offload_optimizer"):
        return preset
    return deep_merge(preset, {"zero_optimization": {"contiguous_gradients": False}})


NO_DEEPSPEED = "none"  # train.deepspeed = "none": plain data parallel (torch DDP); the dict is empty


def build_for_spec(spec: SpecView) -> tuple[dict[str, Any], list[str]]:
    """The final DeepSpeed dict of a JobSpec (world size = ``spec.world_size``) and its warnings.
    ``train.deepspeed = "none"``: {} (no DeepSpeed engine), and a [deepspeed] table is refused."""
    name = spec.train.deepspeed
    if name == NO_DEEPSPEED:
        if spec.deepspeed:
            raise _refuse("deepspeed", "a [deepspeed] table with train.deepspeed = \"none\" (plain DDP): nothing would "
                          "read it", sorted(spec.deepspeed), "drop [deepspeed], or pick a ZeRO preset for train.deepspeed")
        return {}, []
    if is_user_file(name):
        base = load_user_config(name)
        source = name
    else:
        base = one_rank(load_preset(name), spec.world_size)
        source = f"deepspeed preset {name}"
    parallel = spec.parallel
    return build(base, dict(spec.deepspeed), spec.train, spec.world_size, source, parallel.sequence_parallel, parallel.tensor_parallel,
                 parallel.expert)
