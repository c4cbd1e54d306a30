"""The job spec as typed, frozen models: one pydantic model per TOML table (SPEC.md is the contract).

Field types, ranges and cross-field rules live here, next to the fields, each with a domain reason.
Pure: nothing here reads files or the environment. Loading, sweeps and problem reports: ``spec.py``.
"""

from __future__ import annotations

import re
from typing import Any, Literal, get_args

from pydantic import Field, field_validator, model_serializer, model_validator

from ..dsconfig import MAX_NESTING, NO_DEEPSPEED
from ..errors import did_you_mean
from .parallel import ParallelTable, Table
from .sbatch_options import MEM_CONFLICTS, parse_extra
from .sbatch_options import OWNED_SBATCH_OPTIONS as OWNED_SBATCH_OPTIONS  # re-exported
from .train_fields import (  # noqa: F401 -- AttnImplementation, ReportTarget re-exported
    MAX_COUNT,
    TINY_MODELS,
    AttnImplementation,
    DataFields,
    EvalFields,
    GrpoFields,
    HealthFields,
    KernelFields,
    LoraFields,
    MemoryFields,
    ModelFields,
    OptimizerFields,
    PreferenceFields,
    ReportTarget,
    ResumeFields,
    ScheduleFields,
    VisionFields,
)

MAX_SPEC_BYTES = 1_000_000
# transformers' attention implementations the trainer accepts; "auto" = the fastest correct one on the node
ATTN_IMPLEMENTATIONS: tuple[str, ...] = get_args(AttnImplementation)
# TRL 1.x DPOTrainer's loss types; exo_pair is left out: it needs label_smoothing > 0, which the spec does not expose
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
                  "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
# The preflight check names: the one list (the spec's field type, the preflight-only default, the README)
CheckName = Literal["ports", "allreduce", "iperf3", "nvme", "gpu", "disk", "sharedfs"]
CHECKS: tuple[str, ...] = get_args(CheckName)

# Every pattern is applied with fullmatch: `^...$` would let a trailing newline through ("x\n").
_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# one word, not an option, no shell expansion (srun runs it as written: "~/venv/bin/python" is not found)
_PYTHON_RE = re.compile(r"[^\s\-~$`\x00-\x1f\x7f][^\s$`\x00-\x1f\x7f]*")
_SLURM_WORD_RE = re.compile(r"[A-Za-z0-9._,\[\]\-:&|*!()]+")
# sbatch --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
_TIME_RE = re.compile(r"(?:([0-9]+)-)?([0-9]+)(?::([0-9]+))?(?::([0-9]+))?")
_MEM_RE = re.compile(r"[0-9]+[KMGT]?")
MAX_TIME_S = 365 * 86400
# C0 control characters and DEL: never part of a path, a name or an sbatch value
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")

# Variables every rank gets (or derives) on its own; one job-wide [env] table cannot set them. The node refuses
# them too (``slurm.distenv.check_spec_env`` reads this tuple): the one list.
PER_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "NNODES")
# What the batch script and the runtime set for swiftslurm itself: the plan every rank reads, the task index.
RUNTIME_VARS = ("SWIFTSLURM_PLAN", "SWIFTSLURM_TASK")
MAX_PORT = 65532  # MASTER_PORT and the three ports after it (the preflight's) must all be valid


class FieldProblem(ValueError):
    """A validator's refusal of one entry of a table (``env.RANK``): the report names ``key`` under the field's
    path and shows ``found`` (``spec.load`` reads these off pydantic's error)."""

    def __init__(self, key: str, what: str, found: str, hint: str) -> None:
        self.key, self.what, self.found, self.hint = key, what, found, hint
        super().__init__(f"{key}: {what}; found {found}. HINT: {hint}")


def explicit_master_port(value: str) -> int | None:
    """``[env] MASTER_PORT`` as the nodes take it: None when empty (derived from the job id), else a port number
    1-65532; ValueError otherwise. ``slurm.distenv`` applies the same function on every rank."""
    value = value.strip()
    if not value:
        return None
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= MAX_PORT:
        raise ValueError(f"MASTER_PORT in [env] is not a port number (1-{MAX_PORT}): {value!r}")
    return int(value)


# what a shell would expand and nothing here does: "~/runs" would be a directory named "~" in the working dir
_UNEXPANDED_RE = re.compile(r"^~|\$(?:\{|[A-Za-z_])")


def _unexpanded(v: str) -> None:
    if _UNEXPANDED_RE.search(v):
        raise ValueError("a path written out: nothing expands a leading '~' or a $VARIABLE here (TOML is no shell; "
                         "the nodes would get the literal text, and '~/x' would be a directory named '~'). HINT: write "
                         "the absolute path (/home/you/runs), or a path relative to where you run swiftslurm")


def _path(v: str) -> str:
    """A path as the nodes will open it: non-empty, no control characters (a newline or NUL in a path is a typo),
    nothing a shell would have expanded."""
    if not v.strip() or _CONTROL_RE.search(v):
        raise ValueError("a non-empty path without control characters (newline, tab, NUL, ...)")
    _unexpanded(v)
    return v


def _plain_data(value: Any, where: str, depth: int = 0) -> None:
    """A [deepspeed] or [sweep] value must be JSON data: finite numbers, no dates, at most MAX_NESTING deep."""
    if depth > MAX_NESTING:
        raise ValueError(f"{where}: nested more than {MAX_NESTING} levels deep")
    if isinstance(value, dict):
        for key, item in value.items():
            _plain_data(item, f"{where}.{key}", depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _plain_data(item, f"{where}[{i}]", depth + 1)
    elif isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        raise ValueError(f"{where}: a finite number, not {value}")
    elif not isinstance(value, (str, int, float, bool)):
        raise ValueError(f"{where}: a string, number, boolean, list or table, not a TOML {type(value).__name__}")


def time_limit_s(value: str) -> int:
    """Seconds in an sbatch ``--time`` value. Raises ValueError for anything sbatch would refuse."""
    m = _TIME_RE.fullmatch(value)
    if not m:
        raise ValueError(value)
    days, a, b, c = m.groups()
    a, b, c = int(a), (int(b) if b is not None else None), (int(c) if c is not None else None)
    if days is not None:  # D-HH[:MM[:SS]]
        return int(days) * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    if b is None:  # minutes
        return a * 60
    if c is None:  # MM:SS
        return a * 60 + b
    return a * 3600 + b * 60 + c


# allow_inf_nan=False: `num_train_epochs = inf` or `learning_rate = nan` is a typo, never a setting
_Table = Table


class JobTable(_Table):
    name: str = "swiftslurm"
    output_dir: str = "output/swiftslurm"

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME_RE.fullmatch(v) or len(v) > 128:
            raise ValueError("a Slurm job name of letters, digits, '.', '_' and '-' (at most 128)")
        return v

    @field_validator("output_dir")
    @classmethod
    def _out(cls, v: str) -> str:
        return _path(v)


class SlurmTable(_Table):
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclude: str | None = None
    nodelist: str | None = None
    reservation: str | None = None
    nodes: int = Field(1, ge=1, le=4096)
    gpus_per_node: int = Field(0, ge=0, le=64)
    tasks_per_node: int | None = Field(None, ge=1, le=256)
    cpus_per_task: int = Field(1, ge=1, le=1024)
    mem: str | None = None
    time: str = "01:00:00"
    signal_grace_s: int = Field(120, ge=10, le=3600)
    gpu_memory_gb: float = Field(80.0, gt=0, le=100_000)  # per GPU: `plan` warns when the estimate exceeds it
    max_requeues: int = Field(20, ge=0, le=1000)
    no_progress_attempts: int = Field(2, ge=0, le=1000)  # attempts in a row without a newer committed step: then stop (node/requeue.py)
    continue_with: Literal["requeue", "singleton"] = "requeue"  # after a walltime stop (node/chain.py)
    max_restarts: int = Field(0, ge=0, le=100)  # in-job restarts of the training step after a failure or a hang
    spare_nodes: int = Field(0, ge=0, le=64)  # allocated beyond `nodes`; a failed node's replacement at a restart
    shrink_on_failure: bool = False  # no spare left: restart on the nodes that remain (data parallel only)
    array_parallelism: int | None = Field(None, ge=1, le=100_000)
    extra_sbatch: list[str] = Field(default_factory=list)
    setup: list[str] = Field(default_factory=list)
    python: str | None = None
    avoid_bad_nodes: bool = True
    bad_node_ttl_h: float = Field(24.0, gt=0, le=24 * 365)

    @field_validator("partition", "account", "qos", "constraint", "exclude", "nodelist", "reservation")
    @classmethod
    def _word(cls, v: str | None) -> str | None:
        if v is not None and not _SLURM_WORD_RE.fullmatch(v):
            raise ValueError("a Slurm name without spaces or shell characters")
        return v

    @field_validator("mem")
    @classmethod
    def _mem(cls, v: str | None) -> str | None:
        if v is not None and not _MEM_RE.fullmatch(v):
            raise ValueError("sbatch --mem syntax such as '0', '64G' or '500M'")
        return v

    @field_validator("time")
    @classmethod
    def _time(cls, v: str) -> str:
        try:
            if not 0 < time_limit_s(v) <= MAX_TIME_S:
                raise ValueError(v)
        except ValueError:
            raise ValueError("sbatch --time syntax such as '30', '01:00:00' or '1-12:00:00' (at most 365 days)") from None
        return v

    @field_validator("extra_sbatch")
    @classmethod
    def _extra(cls, v: list[str]) -> list[str]:
        out = []
        for opt in v:  # resolved the way sbatch resolves it, and kept under the option's full name
            option, value = parse_extra(opt)
            out.append(f"--{option}" if value is None else f"--{option}={value}")
        return out

    @field_validator("setup")
    @classmethod
    def _setup(cls, v: list[str]) -> list[str]:
        for line in v:
            if any(c in line for c in "\n\r\x00"):
                raise ValueError(f"each setup entry is one shell line (no line breaks or NUL), not {line!r}. HINT: split it into several entries")
        return v

    @field_validator("python")
    @classmethod
    def _python(cls, v: str | None) -> str | None:
        # one word: srun takes what follows its options as the program, so "--export=NONE" would become an srun
        # option and "python -u" a program named "python -u"
        if v is not None and (not _PYTHON_RE.fullmatch(v) or len(v) > 4096):
            raise ValueError("the interpreter the ranks run: a path (/shared/venv/bin/python) or a command on PATH "
                             "(python3), one word without spaces, not starting with '-', without '~' or '$' (nothing expands it). HINT: options for Python "
                             "go in the environment (PYTHONUNBUFFERED, PYTHONOPTIMIZE, ...) via [env]")
        return v

    @property
    def ranks_per_node(self) -> int:
        """One rank per GPU unless tasks_per_node says otherwise."""
        if self.tasks_per_node is not None:
            return self.tasks_per_node
        return self.gpus_per_node or 1

    @property
    def time_limit_s(self) -> int:
        return time_limit_s(self.time)

    @model_validator(mode="after")
    def _cross(self) -> "SlurmTable":
        if self.gpus_per_node and self.tasks_per_node is not None and self.tasks_per_node != self.gpus_per_node:
            raise ValueError(
                f"tasks_per_node ({self.tasks_per_node}) must equal gpus_per_node ({self.gpus_per_node}): "
                "swiftslurm runs one rank per GPU. HINT: drop tasks_per_node or set it to gpus_per_node"
            )
        for opt in self.extra_sbatch:
            option = opt[2:].partition("=")[0]
            if self.mem is not None and option in MEM_CONFLICTS:
                raise ValueError(f"extra_sbatch {opt!r} and slurm.mem = {self.mem!r} both set the memory (sbatch refuses both). "
                                 "HINT: drop one of them")
        if (self.spare_nodes or self.shrink_on_failure) and not self.max_restarts:
            what = f"spare_nodes = {self.spare_nodes}" if self.spare_nodes else "shrink_on_failure = true"
            raise ValueError(f"{what} only matters when a failed training step is restarted inside the job. "
                             "HINT: set slurm.max_restarts (e.g. 3), or drop it")
        if self.signal_grace_s >= self.time_limit_s:
            raise ValueError(
                f"signal_grace_s ({self.signal_grace_s}) must be shorter than the time limit "
                f"({self.time} = {self.time_limit_s} s), or the job is signalled before it starts"
            )
        return self


class TrainTable(HealthFields, ResumeFields, EvalFields, GrpoFields, PreferenceFields, VisionFields, KernelFields,
                 OptimizerFields, LoraFields, MemoryFields, ScheduleFields, DataFields, ModelFields):
    """``[train]``: every concern's fields (``train_fields.py``), flat as users write them. Bases are listed last
    concern first: pydantic orders fields from the last base, so the reference reads model, data, schedule, ..."""

    @field_validator("dataset", "eval_dataset", mode="before")
    @classmethod
    def _one_dataset(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("dataset", "eval_dataset")
    @classmethod
    def _paths(cls, v: list[str]) -> list[str]:
        return [_path(item) for item in v]

    @field_validator("resume_from")
    @classmethod
    def _resume_path(cls, v: str | None) -> str | None:
        return None if v is None else _path(v)

    @field_validator("model")
    @classmethod
    def _model(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or _CONTROL_RE.search(v)):
            raise ValueError("a hub id or a path, without control characters")
        if v is not None:
            _unexpanded(v)
        return v

    @field_validator("command")
    @classmethod
    def _nonempty_items(cls, v: list[str]) -> list[str]:
        for item in v:
            if not item or "\x00" in item:
                raise ValueError("non-empty strings")  # an argv word may hold newlines, never NUL
        return v

    @field_validator("deepspeed")
    @classmethod
    def _ds(cls, v: str) -> str:
        from .. import dsconfig

        if v == NO_DEEPSPEED:
            return v
        if v.endswith(".json") or "/" in v:
            return _path(v)  # a user file: its existence and content are checked by check_files()
        presets = dsconfig.preset_names()
        if v not in presets:
            close = did_you_mean(v, presets)
            hint = f" {close[0].upper()}{close[1:]}" if close else ""
            raise ValueError(f"a preset ({', '.join(presets)}), \"{NO_DEEPSPEED}\" (plain DDP) or a path to a .json file.{hint}")
        return v

    @field_validator("gradient_checkpointing", mode="before")
    @classmethod
    def _checkpointing(cls, v: Any) -> Any:
        if v is True or v is False or v == "auto":
            return v
        raise ValueError('true, false, or "auto" (off where plan\'s memory estimate fits the GPU without it)')

    @field_validator("use_liger_kernel", mode="before")
    @classmethod
    def _liger(cls, v: Any) -> Any:
        if v is True or v is False or v == "auto":
            return v
        raise ValueError('true, false, or "auto" (on GPUs where liger-kernel is installed)')

    @field_validator("dpo_loss_type")
    @classmethod
    def _loss_type(cls, v: str) -> str:
        if v == "exo_pair":
            raise ValueError("exo_pair needs label_smoothing > 0 in TRL, which the spec does not expose. "
                             f"HINT: one of {', '.join(DPO_LOSS_TYPES)}")
        if v not in DPO_LOSS_TYPES:
            close = did_you_mean(v, DPO_LOSS_TYPES)
            raise ValueError(f"one of TRL's DPO loss types: {', '.join(DPO_LOSS_TYPES)}{'; ' + close if close else ''}")
        return v

    @model_validator(mode="after")
    def _cross(self) -> "TrainTable":
        from .eval_rules import eval_problems
        from .training_rules import train_problems

        for message in train_problems(self) + eval_problems(self):
            raise ValueError(message)
        from .grpo_rules import grpo_problems
        from .vision_rules import vision_problems

        for message in grpo_problems(self) + vision_problems(self):
            raise ValueError(message)
        if self.bf16 and self.fp16:
            raise ValueError("bf16 and fp16 are both true; choose one (bf16 on Ampere or newer GPUs)")
        if self.max_steps is not None and self.num_train_epochs is not None:
            raise ValueError("set max_steps or num_train_epochs, not both")
        if not self.command:
            if not self.model:
                raise ValueError("train.model is required unless train.command runs your own script")
            if not self.dataset:
                raise ValueError("train.dataset is required unless train.command runs your own script")
        if self.resume_from is not None and self.command:
            raise ValueError("train.resume_from starts the built-in trainer from a checkpoint; train.command runs your own "
                             "script, which loads its own checkpoints: drop one of them")
        if self.resume_weights_only and self.resume_from is None:
            raise ValueError("train.resume_weights_only = true needs train.resume_from (the checkpoint whose weights to start from)")
        if self.resume_weights_only and self.task in ("dpo", "kto") and self.train_type == "lora":
            raise ValueError(f"train.resume_weights_only with task = \"{self.task}\" and train_type = \"lora\" is not supported (TRL wraps the "
                             "adapter itself): merge the adapter into a model dir and set train.model to it, or resume fully")
        return self

    @property
    def epochs(self) -> float:
        return self.num_train_epochs if self.num_train_epochs is not None else 1.0


class CheckpointTable(_Table):
    keep: int = Field(3, ge=2, le=1000)
    forced_save_fractions: list[float] = Field(default_factory=lambda: [0.1, 0.5, 0.9])
    checksum: Literal["xxh3", "md5", "sha256"] = "xxh3"
    allow_spec_change: bool = False
    convert_timeout_s: int = Field(1800, ge=10, le=86400)
    deadline_save: bool = True
    async_save: Literal["auto"] | bool = "auto"

    @field_validator("forced_save_fractions")
    @classmethod
    def _fractions(cls, v: list[float]) -> list[float]:
        for f in v:
            if not 0 < f < 1:
                raise ValueError(f"fractions strictly between 0 and 1, not {f}")
        return sorted(set(v))


DEFAULT_MIN_IPERF3_GBPS = 20.0  # the floors used when the spec sets none: a miss only warns
DEFAULT_MIN_NVME_IOPS = 50000


class PreflightTable(_Table):
    checks: list[CheckName] = Field(
        default_factory=lambda: list[CheckName](["ports", "allreduce", "iperf3", "nvme"])
    )
    min_allreduce_busbw_gbps: float = Field(0.0, ge=0, le=1_000_000)
    # None: the default floor, which only warns; a value the user sets fails the check (and acts by on_failure)
    min_iperf3_gbps: float | None = Field(None, ge=0, le=1_000_000)
    min_nvme_iops: int | None = Field(None, ge=0, le=MAX_COUNT)
    min_disk_free_gb: float = Field(1.0, ge=0, le=1_000_000_000)
    iperf3_streams: int = Field(8, ge=1, le=128)
    iperf3_duration_s: int = Field(3, ge=1, le=600)
    nvme_path: str | None = None  # None: the NVMe offload path of the DeepSpeed config, else the checkpoint dir
    on_failure: Literal["abort", "warn", "exclude"] = "abort"
    timeout_s: int = Field(60, ge=5, le=3600)

    @field_validator("nvme_path")
    @classmethod
    def _nvme(cls, v: str | None) -> str | None:
        return None if v is None else _path(v)

    @property
    def iperf3_floor(self) -> tuple[float, bool]:
        """(Gbit/s floor, binding): the user's value binds; the default only warns."""
        return (DEFAULT_MIN_IPERF3_GBPS, False) if self.min_iperf3_gbps is None else (self.min_iperf3_gbps, True)

    @property
    def nvme_floor(self) -> tuple[int, bool]:
        """(IOPS floor, binding), as ``iperf3_floor``."""
        return (DEFAULT_MIN_NVME_IOPS, False) if self.min_nvme_iops is None else (self.min_nvme_iops, True)


_MOUNT_RE = re.compile(r"^([^:,\n\r\x00]+):([^:,\n\r\x00]+)(?::([A-Za-z0-9_=+.-]+))?$")
LOCAL_IMAGE_SUFFIXES = (".sif", ".sqsh")


def is_local_image(image: str) -> bool:
    """A container image that is a file on disk (``.sif``/``.sqsh``), not a registry reference."""
    return "://" not in image and "#" not in image and image.endswith(LOCAL_IMAGE_SUFFIXES)


class ContainerTable(_Table):
    runtime: Literal["pyxis", "apptainer"]
    image: str
    mounts: list[str] = Field(default_factory=list)
    workdir: str | None = None
    writable: bool = False
    env: list[str] = Field(default_factory=list)

    @field_validator("image")
    @classmethod
    def _image(cls, v: str) -> str:
        if not v.strip() or v != v.strip() or any(c in v for c in "\n\r\x00,"):
            raise ValueError("an image reference ('nvcr.io#nvidia/pytorch:24.05-py3', 'docker://...') or a path to a .sif/.sqsh file, on one line, "
                             "without commas")
        if is_local_image(v):
            _unexpanded(v)
        return v

    @field_validator("mounts")
    @classmethod
    def _mounts(cls, v: list[str]) -> list[str]:
        for m in v:
            match = _MOUNT_RE.fullmatch(m)
            if not match:
                raise ValueError(f"each mount as 'SRC:DST' or 'SRC:DST:FLAGS' (no commas, no line breaks), not {m!r}")
            if not match.group(2).startswith("/"):
                raise ValueError(f"the mount destination is a path inside the container and must be absolute, not {match.group(2)!r} in {m!r}")
            _unexpanded(match.group(1))  # the source is quoted into the script: "~/data" would reach the runtime as is
        return v

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("/") or any(c in v for c in "\n\r\x00")):
            raise ValueError(f"an absolute path inside the container, on one line, not {v!r}")
        return v

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not _ENV_NAME_RE.fullmatch(name):
                raise ValueError(f"names of environment variables to pass into the container, like NCCL_DEBUG, not {name!r}")
        return v

    @model_validator(mode="after")
    def _cross(self) -> "ContainerTable":
        if self.runtime == "apptainer":
            for m in self.mounts:
                flags = _MOUNT_RE.fullmatch(m).group(3)  # type: ignore[union-attr]
                if flags not in (None, "ro", "rw"):
                    raise ValueError(f"Apptainer bind options are 'ro' or 'rw', not {flags!r} in {m!r}")
        return self


class JobSpec(_Table):
    job: JobTable = Field(default_factory=JobTable)
    slurm: SlurmTable = Field(default_factory=SlurmTable)
    # No [train] table: an empty, unvalidated TrainTable (``has_training`` False), a spec for `swiftslurm preflight`
    # only. A [train] table that is present is validated in full (model or command required).
    train: TrainTable = Field(default_factory=TrainTable.model_construct)
    deepspeed: dict[str, Any] = Field(default_factory=dict)
    checkpoint: CheckpointTable = Field(default_factory=CheckpointTable)
    preflight: PreflightTable = Field(default_factory=PreflightTable)
    env: dict[str, str] = Field(default_factory=dict)
    sweep: dict[str, list[Any]] = Field(default_factory=dict)
    parallel: ParallelTable = Field(default_factory=ParallelTable)
    container: ContainerTable | None = None

    @model_validator(mode="after")
    def _shrink(self) -> "JobSpec":
        p = self.parallel
        if self.slurm.shrink_on_failure and (p.tensor_parallel > 1 or p.sequence_parallel > 1 or p.expert > 1):
            raise ValueError(
                "slurm.shrink_on_failure needs a world whose only split is data parallel: fewer nodes would break the "
                f"tensor_parallel = {p.tensor_parallel} x sequence_parallel = {p.sequence_parallel} groups "
                f"(or the expert = {p.expert} groups of the experts' shards). "
                "HINT: give the job spares (slurm.spare_nodes) instead")
        return self

    @field_validator("env", mode="before")
    @classmethod
    def _env(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        out = {}
        for key, val in v.items():
            if not isinstance(key, str) or not _ENV_NAME_RE.fullmatch(key):
                raise ValueError(f"environment variable names like NCCL_DEBUG, not {key!r}")
            if isinstance(val, bool) or not isinstance(val, (str, int, float)):
                raise ValueError(f"env.{key}: a string value such as \"1\", found {type(val).__name__} {val!r}")
            val = str(val)
            if "\x00" in val:
                raise ValueError(f"env.{key}: no NUL bytes")
            if key in PER_RANK_VARS or key in RUNTIME_VARS:
                why = "derived from Slurm for each rank" if key in PER_RANK_VARS else "the plan and task index the runtime reads"
                raise FieldProblem(key, f"{key} is set by swiftslurm on every rank ({why}); a job-wide [env] value would "
                                   "give every rank the same one, and the nodes refuse it", f"{key} = {val!r}",
                                   "remove it from [env] (MASTER_ADDR and MASTER_PORT may be set there)")
            if key == "MASTER_PORT":
                try:
                    explicit_master_port(val)
                except ValueError:
                    raise FieldProblem(key, f"MASTER_PORT is not a port number (1-{MAX_PORT})", f"{key} = {val!r}",
                                       "remove MASTER_PORT from [env] to let swiftslurm derive one from the job id") from None
            out[key] = val
        return out

    @field_validator("sweep")
    @classmethod
    def _sweep(cls, v: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for key, values in v.items():
            if not values:
                raise ValueError(f"sweep.{key}: at least one value")
            _plain_data(values, f"sweep.{key}")
        return v

    @field_validator("deepspeed")
    @classmethod
    def _ds_table(cls, v: dict[str, Any]) -> dict[str, Any]:
        _plain_data(v, "deepspeed")
        return v

    @property
    def world_size(self) -> int:
        return self.slurm.nodes * self.slurm.ranks_per_node

    @model_validator(mode="after")
    def _grpo_groups(self) -> "JobSpec":
        from .grpo_rules import generation_batch_problem

        problem = generation_batch_problem(self.train, self.world_size, self.parallel) if self.has_training else None
        if problem:
            raise ValueError(problem)
        return self

    @property
    def has_training(self) -> bool:
        """Whether the spec has a [train] table (a validated one always names a model or a command)."""
        return bool(self.train.command) or self.train.model is not None

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> Any:
        data = handler(self)
        if isinstance(data, dict) and not self.has_training:
            data.pop("train", None)  # no [train] stays no [train] through the plan file (an empty one is invalid)
        return data
