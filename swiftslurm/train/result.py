"""What a training run ends with: ``TrainResult``, its summary lines and the summary record rank 0 writes
(``<task dir>/train-summary.json``). Pure of the training stack, so the login-side commands (``submit --wait``,
``status``, ``doctor``) read it without importing the trainer.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..fsutil import RECORD_CAP, atomic_write_text, read_json
from ..taskdir import SUMMARY_FILE
from ..tasks import summary_line


@dataclass
class TrainResult:
    global_step: int
    final_loss: float | None
    tokens_per_s: float | None
    stopped_for_requeue: bool
    checkpoints: list[str] = field(default_factory=list)
    save_seconds: list[float] = field(default_factory=list)
    tensorboard_dir: str | None = None
    metrics_file: str | None = None
    wall_s: float = 0.0
    optimizer: str = ""
    useful_tokens: int = 0  # non-padding tokens trained on in this run (all ranks; since the start or resume)
    total_tokens: int = 0  # every position computed, padding included
    useful_tokens_per_s: float | None = None
    padding_ratio: float | None = None
    attn_implementation: str = ""
    liger: str = "off"  # kernels.liger_names: "off", "all", or the kernels on ("rope+rms_norm+swiglu")
    packing: bool = False
    fp8_layers: int = 0  # train.fp8: linear layers that ran their matmuls in FP8 (0: off)
    gradient_checkpointing: bool = False  # what the model on the node ran with (is_activation_checkpointing), not only what was asked
    checkpointed_layers: tuple[int, int] = (0, 0)  # (decoder layers that recompute, decoder layers) as the model ran
    task: str = "sft"
    reward_accuracy: float | None = None  # DPO: the last logged rewards/accuracies; rm: the last logged accuracy
    reward_margin: float | None = None  # rm: the last logged margin; KTO: the last logged rewards/margins
    stop_reason: str = ""  # why it ended before max_steps/epochs, other than a walltime stop (early stopping)
    eval_loss: float | None = None  # train.eval_*: the last eval_loss
    metric_for_best_model: str = ""
    best_metric: float | None = None  # the best value of metric_for_best_model, at best_step
    best_step: int | None = None
    best_checkpoint: str | None = None  # what latest_best names
    rewards: tuple[float | None, float | None] = (None, None)  # GRPO: the first and last logged mean reward


def write_summary(result: TrainResult, output_dir: str, first_loss: float | None) -> str:
    """Rank 0: the summary's lines, written with the result as the summary record; returns the lines."""
    text = summary(result, output_dir, first_loss)
    body = {**dataclasses.asdict(result), "first_loss": first_loss, "text": text}
    atomic_write_text(Path(output_dir) / SUMMARY_FILE, json.dumps(body, indent=2))
    return text


def read_summary(output_dir: str) -> str | None:
    """The end-of-training summary rank 0 wrote (for `submit --wait` to print), or None."""
    try:
        text = read_json(Path(output_dir) / SUMMARY_FILE, RECORD_CAP).get("text")
    except (OSError, ValueError):  # none, or Unreadable
        return None
    return text if isinstance(text, str) else None


def _fp8(result: TrainResult) -> str:
    return f"{result.fp8_layers} layers" if result.fp8_layers else "off"


def _checkpointing(result: TrainResult) -> str:
    """"off", "on", or "on for 16 of 32 layers" (gradient_checkpointing_layers below the model's count)."""
    recomputing, layers = result.checkpointed_layers
    if not result.gradient_checkpointing:
        return "off"
    return f"on for {recomputing} of {layers} layers" if 0 < recomputing < layers else "on"


def summary(result: TrainResult, output_dir: str, first_loss: float | None) -> str:
    """The end-of-training lines printed on rank 0."""
    def fmt(x, spec=".4f"):
        return "n/a" if x is None else format(x, spec)

    how = ("stopped for requeue (walltime signal)" if result.stopped_for_requeue
           else "stopped early" if result.stop_reason else "finished")
    lines = [
        f"swiftslurm: training {how} at step {result.global_step} in {result.wall_s:.1f} s",
        f"  loss: first {fmt(first_loss)} -> final {fmt(result.final_loss)}",
        f"  throughput: {fmt(result.useful_tokens_per_s, '.1f')} useful tokens/s (all ranks, padding excluded; "
        f"{result.useful_tokens} of {result.total_tokens} positions, padding {fmt(result.padding_ratio, '.1%')}); "
        f"optimizer {result.optimizer or '?'}",
        f"  kernels: attention {result.attn_implementation or '?'}, Liger {result.liger}, "
        f"packing {'on' if result.packing else 'off'}, FP8 {_fp8(result)}, gradient checkpointing {_checkpointing(result)}",
        f"  checkpoints: {output_dir}/checkpoint-<step> (latest: {Path(result.checkpoints[-1]).name if result.checkpoints else 'none'}); "
        f"`swiftslurm verify {output_dir}` checks them",
    ]
    own = summary_line(result.task, dataclasses.asdict(result))  # the task's own line (swiftslurm/tasks.py)
    if own:
        lines.insert(2, f"  {own}")
    if result.stop_reason:
        lines.insert(1, f"  {result.stop_reason}")
    if result.metric_for_best_model:
        best = Path(result.best_checkpoint).name if result.best_checkpoint else "none"
        lines.append(f"  evaluation: last eval_loss {fmt(result.eval_loss)}; best {result.metric_for_best_model} {fmt(result.best_metric)} "
                     f"at step {result.best_step if result.best_step is not None else 'n/a'} ({best}; {output_dir}/latest_best names it)")
    if result.tensorboard_dir:
        lines.append(f"  TensorBoard: tensorboard --logdir {result.tensorboard_dir}")
    if result.metrics_file:
        lines.append(f"  metrics: {result.metrics_file}")
    return "\n".join(lines)
