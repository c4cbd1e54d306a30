"""What a checkpoint was trained with: the training-relevant spec, recorded in its manifest meta
(``meta["spec_fingerprint"]``) and compared when a task resumes from it.

The fingerprint holds the values themselves (dotted key -> value), not a hash, so a refused resume can
name what changed. It covers every ``train.*`` key except the operational ones below, the ``[deepspeed]``
overrides, the essentials of the resolved DeepSpeed config, and the identity of each dataset file
(name, size, a hash of its first and last MiB). It leaves out the allocation (nodes, ranks per node,
time, partition), ``[preflight]``, ``[env]`` and ``[checkpoint]``: resuming on another world size
must keep working, and none of those change what is learned.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from ..errors import RuntimeEnvError
from ..fsutil import open_regular
from .manifest import read_manifest

if TYPE_CHECKING:
    from ..spec.model import JobSpec

META_KEY = "spec_fingerprint"
# train.* keys that do not change what is learned (or are covered below: the dataset by its content, the
# deepspeed preset by the resolved config's essentials)
OPERATIONAL_TRAIN_KEYS = frozenset({
    "logging_steps", "save_steps", "report_to", "command", "dataloader_num_workers", "dataloader_pin_memory",
    "dataset_num_proc", "dataset_scan", "model_shape", "resume_from", "resume_weights_only", "dataset", "deepspeed",
    "attn_implementation", "use_liger_kernel",  # kernels: the same math, chosen per node
    "max_steps", "num_train_epochs",  # how long: extending a run is normal (a schedule over max_steps then stretches)
    "ddp_timeout",  # how long a collective may wait: not what is learned
    # evaluation watches the training, it does not change a step (eval_split does: it holds out training records)
    "eval_dataset", "eval_steps", "per_device_eval_batch_size", "metric_for_best_model", "greater_is_better",
    "early_stopping_patience",
    "straggler_window", "straggler_factor",  # who is named slow: not what is learned
    # recomputing activations and compiling the layers compute the same step ("auto" checkpointing may resolve
    # otherwise on a resubmission with another slurm.gpu_memory_gb: that must not refuse the resume)
    "gradient_checkpointing", "compile",
})
# what of the resolved DeepSpeed config changes the training (train_batch_size scales with the world size: not here)
DS_ESSENTIALS = (
    "zero_optimization.stage", "zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.device",
    "bf16.enabled", "fp16.enabled", "gradient_clipping", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
)
EDGE_BYTES = 1 << 20


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for key in sorted(value):
            _flatten(value[key], f"{prefix}.{key}", out)
    else:
        out[prefix] = value


def _dig(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def spec_fingerprint(spec: JobSpec, ds_config: dict[str, Any] | None, datasets: Iterable[str]) -> dict[str, Any]:
    """Pure: the fingerprint of a task's spec, given its resolved DeepSpeed config and its dataset identities."""
    out: dict[str, Any] = {}
    train = spec.train.model_dump(mode="json")
    for key in sorted(train):
        if key not in OPERATIONAL_TRAIN_KEYS:
            out[f"train.{key}"] = train[key]
    if spec.deepspeed:
        _flatten(dict(spec.deepspeed), "deepspeed", out)
    for dotted in DS_ESSENTIALS:
        out[f"ds_config.{dotted}"] = _dig(ds_config or {}, dotted)
    for i, identity in enumerate(datasets):
        out[f"dataset[{i}]"] = identity
    return json.loads(json.dumps(out))  # as it reads back from the manifest (tuples -> lists, ...)


def dataset_identity(path: str) -> str:
    """A file's name, size and a hash of its first and last MiB: cheap on large files, and changed by any
    edit that adds, drops or rewrites samples at either end or changes the size. Reads the file. A
    directory (datasets' save_to_disk) is the identities of its files, in name order."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file())
        return f"{p.name}/: " + "; ".join(dataset_identity(str(f)) for f in files)
    try:
        size = p.stat().st_size
        digest = hashlib.sha256()
        with open_regular(p) as fh:  # never a FIFO or a device under a dataset's name
            digest.update(fh.read(EDGE_BYTES))
            if size > EDGE_BYTES:
                fh.seek(max(EDGE_BYTES, size - EDGE_BYTES))
                digest.update(fh.read(EDGE_BYTES))
    except OSError as exc:
        return f"{p.name}: unreadable ({exc.strerror})"
    return f"{p.name}: {size} bytes, sha256 {digest.hexdigest()[:16]} (first+last MiB)"


def training_fingerprint(spec: JobSpec, ds_config: dict[str, Any] | None) -> dict[str, Any]:
    """The fingerprint of a task as it starts now (reads the dataset files)."""
    return spec_fingerprint(spec, ds_config, [dataset_identity(d) for d in spec.train.dataset])


def train_defaults() -> dict[str, Any]:
    """``train.<key>``: its default, as the fingerprint records it."""
    from ..spec.model import TrainTable

    return {f"train.{k}": f.get_default(call_default_factory=True) for k, f in TrainTable.model_fields.items()}


def fingerprint_changes(recorded: dict[str, Any], current: dict[str, Any], defaults: dict[str, Any] | None = None) -> list[str]:
    """Pure: ``key: recorded -> current`` for every key whose value differs (``(unset)`` where one side lacks it).
    A key the recorded fingerprint lacks whose current value is its default (``defaults``) is no change: a newer
    swiftslurm added the key, and its default is what the older one did (train.max_grad_norm = 1.0 was HF's)."""
    missing = object()
    out = []
    for key in sorted(set(recorded) | set(current)):
        old, new = recorded.get(key, missing), current.get(key, missing)
        if old is missing and defaults is not None and key in defaults and defaults[key] == new:
            continue
        if old != new:
            show = lambda v: "(unset)" if v is missing else json.dumps(v)  # noqa: E731
            out.append(f"{key}: {show(old)} -> {show(new)}")
    return out


def check_spec_drift(checkpoint: Path | str, spec: JobSpec, ds_config: dict[str, Any] | None, log: Any) -> None:
    """Refuse to resume a checkpoint trained with another training spec (an edited sweep list renumbers
    tasks; a changed learning rate), naming the changed keys, unless checkpoint.allow_spec_change.

    Called by the trainer on the resume point all ranks agreed on; ``log`` is a ``logging.Logger``."""
    checkpoint = Path(checkpoint)
    meta = read_manifest(checkpoint).meta
    recorded = meta.get(META_KEY)
    if not isinstance(recorded, dict) and isinstance(meta.get("source"), dict):
        log.warning("%s was imported (%s, written by another tool): resuming without checking that it was trained "
                    "with this spec", checkpoint.name, meta["source"].get("kind", "?"))
        return
    if not isinstance(recorded, dict):
        log.warning("%s has no spec fingerprint (written by an older swiftslurm): resuming without checking "
                    "that it was trained with this spec", checkpoint.name)
        return
    changes = fingerprint_changes(recorded, training_fingerprint(spec, ds_config), train_defaults())
    if not changes:
        return
    if spec.checkpoint.allow_spec_change:
        log.warning("resuming %s although the spec changed (checkpoint.allow_spec_change = true): %s", checkpoint.name, "; ".join(changes))
        return
    raise RuntimeEnvError(
        f"{checkpoint.name} was trained with another spec; not resuming it",
        f"{checkpoint}: " + "; ".join(changes),
        "restore those values, or use a new job.output_dir to start fresh, or set checkpoint.allow_spec_change = true "
        "to resume anyway (editing a sweep list renumbers its tasks: task N's directory may hold another combination's checkpoints)",
    )


PARALLEL_KEY = "parallel"
NO_PARALLEL = {"sequence_parallel": 1, "tensor_parallel": 1, "expert": 1}  # what a checkpoint without the record was trained with


def check_parallel_degrees(checkpoint: Path | str, degrees: dict[str, int]) -> None:
    """Refuse to resume a checkpoint saved at other sequence/tensor parallel degrees: its DeepSpeed shards
    (``mp_rank_XX`` per TP rank, ZeRO partitions over the SP ranks) only load at the degrees that wrote them.
    Not overridable by checkpoint.allow_spec_change: converting is the universal-checkpoint path's job."""
    checkpoint = Path(checkpoint)
    recorded = read_manifest(checkpoint).meta.get(PARALLEL_KEY) or NO_PARALLEL
    changed = [f"{key} {recorded.get(key, 1)} -> {value}" for key, value in degrees.items() if recorded.get(key, 1) != value]
    if changed:
        raise RuntimeEnvError(
            f"{checkpoint.name} was saved at other parallel degrees; its DeepSpeed shards cannot be loaded at these",
            f"{checkpoint}: " + ", ".join(changed),
            "restore [parallel] to the degrees it was saved with to resume, or start fresh in a new job.output_dir "
            "(resuming at another degree needs a universal-checkpoint conversion, not done here)",
        )
