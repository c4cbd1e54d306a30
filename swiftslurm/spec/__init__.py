"""The job spec: TOML -> a typed, frozen ``JobSpec`` (``model``), loading, problem reports and sweeps (``load``),
and the README's generated reference (``doc``).

May import only the base modules (``errors``, ``dsconfig``); everything downstream imports it.
``from swiftslurm.spec import JobSpec, load_spec`` is the public path.
"""

from .load import (
    NO_TRAIN_NOTE,
    apply_overrides,
    check_files,
    load_raw,
    load_spec,
    parse_spec,
    parse_toml,
    require_training,
    sweep_key_path,
    validate_spec,
)
from .model import (
    CHECKS,
    MAX_SPEC_BYTES,
    OWNED_SBATCH_OPTIONS,
    TINY_MODELS,
    CheckpointTable,
    JobSpec,
    JobTable,
    PreflightTable,
    SlurmTable,
    TrainTable,
    time_limit_s,
)

__all__ = [
    "CHECKS", "MAX_SPEC_BYTES", "OWNED_SBATCH_OPTIONS", "TINY_MODELS", "CheckpointTable", "JobSpec", "JobTable",
    "PreflightTable", "SlurmTable", "TrainTable", "time_limit_s", "apply_overrides", "check_files", "load_raw",
    "load_spec", "parse_spec", "parse_toml", "require_training", "sweep_key_path", "validate_spec", "NO_TRAIN_NOTE",
]
