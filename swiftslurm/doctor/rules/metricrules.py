"""Findings from metrics.jsonl: NaN/inf losses and grad norms, a loss or grad norm that blew up while staying
finite (``diverged``), and the speed diagnosis in its steps:
(1) are the GPUs busy (``low_gpu_util``)? if not, (2) do collectives eat the step (``comm_bound``)?
(3) does the data loader keep them waiting (``data_bound``)? (4) otherwise the step itself is the cost
(micro-batch, sequence length, kernels): no finding, ``plan``'s estimate and the MFU in the metrics say how far."""

from __future__ import annotations

import math
import statistics
from typing import Any

from ...taskdir import METRICS_FILE
from ..evidence import TaskRun
from ..findings import Evidence, Finding

NAN_STEPS = 10  # consecutive logged steps with a non-finite loss or grad_norm
# diverged: where the run ENDED (the median of its last window of logged rows: one noisy row moves it not)
# against where it BEGAN (the lowest of its first window: a run that blows up within its first few logged
# steps, as lr = 10 does by step 2, still has its step-1 value there); the two windows never overlap
DIVERGE_WINDOW = 3  # logged rows per window (fewer when the run logged fewer than 2 x 3 rows)
DIVERGE_MIN_ROWS = 4  # below this, two windows of 2 rows: too little to tell a trend from noise
LOSS_RISE = 4.0  # the loss ends at over 4x where it began ...
LOSS_RISE_ABS = 1.0  # ... and over 1.0 higher (a loss near 0 going 0.05 -> 0.2 is noise, not divergence)
GRAD_RISE = 100.0  # the grad norm ends at over 100x where it began ...
GRAD_MIN = 10.0  # ... and over 10 (early norms of 0.01 growing to 1, as LoRA's do from B = 0, are healthy)
GPU_UTIL_MIN = 0.85
COMM_RATIO_MAX = 0.30
DATA_RATIO_MAX = 0.20
WARMUP_ROWS = 1  # the first logged rows hold compilation, allocator warm-up, the first all-gathers
MIN_ROWS = 3  # fewer steady rows than this say nothing about speed
GPU_UTIL_KEYS = ("gpu_util", "gpu_utilization", "gpu_util_mean", "gpu_util_pct", "gpu_util_percent")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:  # an int of hundreds of digits
        return math.inf if value > 0 else -math.inf


def _non_finite(value: Any) -> bool:
    if isinstance(value, str):  # some writers spell them out
        return value.strip().lower() in ("nan", "inf", "-inf", "infinity", "-infinity")
    x = _number(value)
    return x is not None and not math.isfinite(x)


def _evidence(row: tuple[int, dict[str, Any]], key: str) -> Evidence:
    number, data = row
    step = data.get("step") if isinstance(data.get("step"), int) else None
    return Evidence(METRICS_FILE, number, 0, "", step, f"{key} = {data.get(key)!r}")


def nan_grad_norm(run: TaskRun) -> list[Finding]:
    """A run of NAN_STEPS consecutive logged training rows whose loss or grad_norm is NaN/inf."""
    streak: list[tuple[int, dict[str, Any]]] = []
    best: list[tuple[int, dict[str, Any]]] = []
    for number, row in run.metrics:
        if "loss" not in row and "grad_norm" not in row:
            continue  # a save or an eval row
        if _non_finite(row.get("loss")) or _non_finite(row.get("grad_norm")):
            streak.append((number, row))
            best = streak if len(streak) > len(best) else best
        else:
            streak = []
    if len(best) < NAN_STEPS:
        return []
    key = "grad_norm" if _non_finite(best[0][1].get("grad_norm")) else "loss"
    lr = run.train("learning_rate")
    clip = run.train("max_grad_norm", 1.0)
    clip_now = f", now {clip:g}" if isinstance(clip, (int, float)) else ""
    return [Finding(
        "nan_grad_norm", f"{key} was NaN/inf for {len(best)} consecutive logged steps from step {best[0][1].get('step')}",
        "the updates diverged: the learning rate is too high for this model and batch, or fp16 overflowed "
        "(bf16 does not), or a bad sample (empty labels) produced an undefined loss",
        f"lower train.learning_rate{f' (now {lr:g})' if isinstance(lr, (int, float)) else ''}, clip gradients harder "
        f"(train.max_grad_norm = 0.5{clip_now}), use bf16 instead of fp16 (train.bf16 = true, train.fp16 = false), add warm-up",
        ("train.learning_rate", "train.max_grad_norm", "train.bf16", "train.fp16"),
        (_evidence(best[0], key), _evidence(best[-1], key)), run.task, (0,))]


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


ROUTER_ROWS = 3  # consecutive logged rows
ROUTER_COLLAPSED = 0.8  # of the ceiling (experts / top_k: every token to the same top_k experts)


def router_collapse(run: TaskRun) -> list[Finding]:
    """An MoE model's router collapsed: in each of the last ROUTER_ROWS logged rows, the worst layer's tokens per
    expert (max/mean, ``router_load_max``) at ROUTER_COLLAPSED or more of its ceiling (``router_load_limit``)."""
    rows = [(n, r) for n, r in run.metrics if _finite(r.get("router_load_max")) and _finite(r.get("router_load_limit"))]
    last = rows[-ROUTER_ROWS:]
    if len(last) < ROUTER_ROWS or not all(r["router_load_max"] >= ROUTER_COLLAPSED * r["router_load_limit"] > 1
                                          for _, r in last):
        return []
    coef = run.train("router_aux_loss_coef")
    now = f" (now {coef:g})" if isinstance(coef, (int, float)) else " (unset: the model's own, else 0.001)"
    limit = last[-1][1]["router_load_limit"]
    return [Finding(
        "router_collapse", f"an MoE router sent nearly every token to the same experts: tokens per expert max/mean "
        f"{last[-1][1]['router_load_max']:.2f} of at most {limit:g}, in the last {ROUTER_ROWS} logged steps",
        "a collapsed router: its load-balancing loss is off or too weak for this learning rate, so the experts it "
        "stopped choosing no longer train",
        f"raise train.router_aux_loss_coef{now}: Qwen3-MoE and Mixtral use 0.001, OLMoE 0.01; lower "
        "train.learning_rate; resume from a checkpoint before the collapse",
        ("train.router_aux_loss_coef", "train.learning_rate"),
        (_evidence(last[0], "router_load_max"), _evidence(last[-1], "router_load_max")), run.task, (0,))]


def _finite_series(run: TaskRun, key: str) -> list[tuple[float, tuple[int, dict[str, Any]]]]:
    """(value, row) of every logged row whose ``key`` is a finite number, in file order."""
    out = []
    for row in run.metrics:
        x = _number(row[1].get(key))
        if x is not None and math.isfinite(x):
            out.append((x, row))
    return out


def _rise(series: list[tuple[float, tuple[int, dict[str, Any]]]]) -> tuple[float, float, tuple[int, dict[str, Any]], tuple[int, dict[str, Any]], int] | None:
    """(start, end, the row of the start, the last row, window): start is the lowest of the first window,
    end the median of the last; None when there are fewer than DIVERGE_MIN_ROWS rows."""
    if len(series) < DIVERGE_MIN_ROWS:
        return None
    k = min(DIVERGE_WINDOW, len(series) // 2)
    base, row = min(series[:k], key=lambda v: v[0])
    end = statistics.median(v for v, _ in series[-k:])
    return base, end, row, series[-1][1], k


def diverged(run: TaskRun) -> list[Finding]:
    """The loss ended far above where it began (the median of the last DIVERGE_WINDOW logged losses > LOSS_RISE x the
    lowest of the first ones, and LOSS_RISE_ABS higher), or the grad norm did (GRAD_RISE x, above GRAD_MIN), every value
    finite. A run the NaN rule already explains is left to it (the same cause: NaN is where divergence ends)."""
    if nan_grad_norm(run):
        return []
    seen: list[str] = []
    evidence: list[Evidence] = []
    loss = _rise(_finite_series(run, "loss"))
    if loss and loss[1] > LOSS_RISE * loss[0] and loss[1] - loss[0] > LOSS_RISE_ABS:
        base, end, near, last, k = loss
        seen.append(f"the loss rose from {base:.4g} (the lowest of the first {k} logged steps) to {end:.4g} "
                    f"(the median of the last {k}, to step {last[1].get('step')})")
        evidence += [_evidence(near, "loss"), _evidence(last, "loss")]
    grad = _rise(_finite_series(run, "grad_norm"))
    if grad and grad[0] > 0 and grad[1] > GRAD_RISE * grad[0] and grad[1] > GRAD_MIN:
        base, end, near, last, k = grad
        seen.append(f"the grad norm rose from {base:.4g} to {end:.4g} ({end / base:.0f}x)")
        evidence += [_evidence(near, "grad_norm"), _evidence(last, "grad_norm")]
    if not seen:
        return []
    lr = run.train("learning_rate")
    lr_now = f" (now {lr:g}; try {lr / 10:g})" if isinstance(lr, (int, float)) and not isinstance(lr, bool) else ""
    clip = run.train("max_grad_norm", 1.0)
    clip_now = f", now {clip:g}" if isinstance(clip, (int, float)) and not isinstance(clip, bool) else ""
    return [Finding(
        "diverged", "; ".join(seen) + ", with every value finite: the run diverged instead of learning",
        "the updates overshoot: the learning rate is too high for this model and batch (or there is no warm-up), "
        "so each step moves the weights further from a minimum; nothing became NaN, so no other check stopped it",
        f"lower train.learning_rate{lr_now}, add warm-up (train.warmup_ratio = 0.03), clip gradients harder "
        f"(train.max_grad_norm = 0.5{clip_now}); resume from a checkpoint saved before the rise, or start over",
        ("train.learning_rate", "train.warmup_ratio", "train.max_grad_norm"), tuple(evidence), run.task, (0,))]


def _steady(run: TaskRun) -> list[tuple[int, dict[str, Any]]]:
    rows = [(n, r) for n, r in run.metrics if "loss" in r or "step_time_s" in r]
    return rows[WARMUP_ROWS:] if len(rows) > WARMUP_ROWS + MIN_ROWS - 1 else rows


def _median(rows: list[tuple[int, dict[str, Any]]], keys: tuple[str, ...], scale_pct: bool = False) -> tuple[float, tuple[int, dict[str, Any]], str] | None:
    """The median over the rows carrying one of ``keys`` (first key found per row) and the row nearest it."""
    values = []
    for row in rows:
        for key in keys:
            x = _number(row[1].get(key))
            if x is not None and math.isfinite(x):
                if scale_pct and x > 1.0:
                    x /= 100.0  # a percentage
                values.append((x, row, key))
                break
    if len(values) < MIN_ROWS:
        return None
    med = statistics.median(v for v, _, _ in values)
    x, row, key = min(values, key=lambda v: abs(v[0] - med))
    return med, row, key


def gpu_util(run: TaskRun) -> float | None:
    found = _median(_steady(run), GPU_UTIL_KEYS, scale_pct=True)
    return found[0] if found else None


def _lowest_rank(row: dict[str, Any]) -> tuple[int, float] | None:
    """(rank, utilisation) of the least busy GPU in a row the trainer wrote (``gpu_util_min_rank``), or None."""
    rank, low = _number(row.get("gpu_util_min_rank")), _number(row.get("gpu_util_min"))
    if rank is None or low is None or not rank.is_integer():
        return None
    return int(rank), (low / 100.0 if low > 1.0 else low)


def speed(run: TaskRun) -> list[Finding]:
    rows = _steady(run)
    out: list[Finding] = []
    util = _median(rows, GPU_UTIL_KEYS, scale_pct=True)
    comm = _median(rows, ("comm_wait_ratio",))
    data = _median(rows, ("data_wait_ratio",))
    idle = util is not None and util[0] < GPU_UTIL_MIN
    if idle and util is not None:
        why = []
        if comm and comm[0] > COMM_RATIO_MAX:
            why.append("collectives (comm_bound below)")
        if data and data[0] > DATA_RATIO_MAX:
            why.append("the data loader (data_bound below)")
        low = _lowest_rank(util[1][1])
        out.append(Finding(
            "low_gpu_util", f"the GPUs were busy {util[0]:.0%} of the time (median over {len(rows)} logged steps; below {GPU_UTIL_MIN:.0%})"
            + (f"; the least busy: rank {low[0]} at {low[1]:.0%}" if low else ""),
            "the GPUs wait for " + (" and ".join(why) if why else "something outside the step: host-side work between kernels, "
                                    "small micro-batches, CPU offload"),
            "follow the next findings; with none, raise train.per_device_train_batch_size (GPU memory allowing) and avoid CPU offload",
            ("train.per_device_train_batch_size", "train.deepspeed"), (_evidence(util[1], util[2]),), run.task,
            (low[0],) if low else ()))
    if comm and comm[0] > COMM_RATIO_MAX:
        preset = str(run.train("deepspeed", "") or "")
        out.append(Finding(
            "comm_bound", f"collectives took {comm[0]:.0%} of each step (median comm_wait_ratio; above {COMM_RATIO_MAX:.0%})",
            "gradients and parameters cross the network each step faster than the GPUs compute: small buckets, a slow or "
            "TCP-only interconnect (InfiniBand off, wrong interface), or ZeRO-3 gathering every layer",
            ("train.deepspeed = \"zero2_fast\" (larger buckets)" if preset != "zero2_fast" else "larger buckets in [deepspeed]")
            + "; more train.gradient_accumulation_steps (fewer gradient syncs per sample); check the NCCL environment "
            "(env.NCCL_IB_DISABLE = \"0\", env.NCCL_SOCKET_IFNAME) and the preflight's allreduce and iperf3 findings on the topology",
            ("train.deepspeed", "train.gradient_accumulation_steps", "env.NCCL_IB_DISABLE", "env.NCCL_SOCKET_IFNAME"),
            (_evidence(comm[1], comm[2]),), run.task))
    if data and data[0] > DATA_RATIO_MAX and (util is None or idle):
        out.append(Finding(
            "data_bound", f"the step waited for data {data[0]:.0%} of the time (median data_wait_ratio; above {DATA_RATIO_MAX:.0%})",
            "batches are built in the training process (tokenizing, collating, reading) while the GPUs idle",
            "more loader processes (train.dataloader_num_workers), pinned memory (train.dataloader_pin_memory = true), "
            "tokenize once and cache (train.dataset_num_proc; packing's cache)",
            ("train.dataloader_num_workers", "train.dataloader_pin_memory", "train.dataset_num_proc"),
            (_evidence(data[1], data[2]),), run.task))
    return out
