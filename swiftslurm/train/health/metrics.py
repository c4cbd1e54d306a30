"""What the trainer measures, and where it goes (TensorBoard via the Trainer's logs, and metrics.jsonl).

Every number is measured on this rank with ``time.perf_counter``, not derived from a formula that
assumes the answer (docs/training.md says how each is measured):

- step time: from the start of a step's batch fetch to the Trainer's ``on_step_end`` (fwd, bwd,
  optimizer); checkpoint saves and logging are outside it.
- data wait: time inside ``next(dataloader)`` for the step's micro-batches.
- comm wait: time inside DeepSpeed's collectives (``deepspeed.comm.all_reduce``, ``reduce_scatter_*``,
  ``all_gather_*``, ``broadcast``, ``barrier``, ...), wrapped by ``CommTimer``; nested calls count once.
  On the CPU (gloo, synchronous) that is wall time around the call. On GPUs NCCL calls return as soon
  as the kernel is queued, so wall time would only measure the launch: there each collective is
  bracketed by CUDA events on the stream it was issued on, and the events are read (one
  synchronize) only at logging steps, so the measurement adds no sync to the step.
- tokens / samples, summed over ranks with one all-reduce per logging step, of the batches actually fetched:
  ``total_tokens`` = every position of every row (padding included: what the GPU computes);
  ``useful_tokens`` = positions holding a real sample token (prompt and response alike, i.e. not padding;
  the label-bearing ones are a subset); ``padding_ratio`` = 1 - useful / total; samples = training
  examples (a packed row holds several). ``tokens_per_s`` and ``useful_tokens_per_s`` are the same number
  (useful tokens per second of step time); MFU is computed from it. A packed batch carries its counts
  under ``STATS_PREFIX`` keys; a padded one is counted from its ``attention_mask``.
- memory: CPU RSS (VmRSS) always; GPU allocated / peak from the CUDA caching allocator on GPUs.
- MFU (GPU only, peak FLOPs from a table): model FLOPs per token x measured tokens/s / peak.
- GPU utilisation (GPU only, NVML through nvidia-ml-py; absent otherwise): each rank's share of time a kernel ran,
  sampled every 0.5 s (``gpuutil``); ``gpu_util`` is the mean over ranks (a fraction 0..1), ``gpu_util_min`` and
  ``gpu_util_min_rank`` the lowest and whose.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ...fsutil import open_append

# dense bf16 peak TFLOP/s per GPU (no sparsity), by a substring of torch.cuda.get_device_name()
PEAK_TFLOPS_BF16 = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0, "L4": 121.0, "V100": 125.0}

STATS_PREFIX = "swiftslurm_stat_"  # batch keys the collators add for the meter; taken out before forward

COMM_FUNCTIONS = (
    "all_reduce", "inference_all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_fn", "all_gather", "all_gather_into_tensor", "allgather_fn",
    "all_gather_coalesced", "broadcast", "barrier", "all_to_all_single", "gather", "scatter",
)


class CommTimer:
    """Seconds spent inside DeepSpeed's collectives on this rank (a hook on ``deepspeed.comm``)."""

    def __init__(self, cuda: bool | None = None) -> None:
        self.seconds = 0.0  # CPU: wall seconds inside collectives
        self.calls = 0
        self._depth = 0
        self._originals: dict[str, Any] = {}
        if cuda is None:
            import torch

            cuda = torch.cuda.is_available()
        self.cuda = cuda
        self.in_step = False  # GPU: only collectives issued inside a training step are timed
        self._events: list[tuple[Any, Any]] = []

    def _wrap(self, fn):
        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            events = None
            if self.cuda and self.in_step:
                import torch

                events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                events[0].record()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if events is not None:
                    events[1].record()
                    self._events.append(events)
                else:
                    self.seconds += time.perf_counter() - start
                self.calls += 1
                self._depth -= 1

        timed.__wrapped__ = fn  # type: ignore[attr-defined]  # a function attribute, as functools.wraps sets it (tests find the patches by it)
        return timed

    def drain_gpu_seconds(self) -> float:
        """GPU seconds of the collectives timed since the last call (synchronizes on their end events)."""
        total = 0.0
        for start, end in self._events:
            end.synchronize()
            total += start.elapsed_time(end) / 1000.0
        self._events.clear()
        return total

    def install(self) -> "CommTimer":
        import deepspeed.comm as dscomm
        import deepspeed.comm.comm as dscomm_impl

        for name in COMM_FUNCTIONS:
            fn = getattr(dscomm_impl, name, None)
            if fn is None or name in self._originals:
                continue
            self._originals[name] = fn
            wrapped = self._wrap(fn)
            setattr(dscomm_impl, name, wrapped)
            if getattr(dscomm, name, None) is fn:
                setattr(dscomm, name, wrapped)
        return self

    def uninstall(self) -> None:
        import deepspeed.comm as dscomm
        import deepspeed.comm.comm as dscomm_impl

        for name, fn in self._originals.items():
            setattr(dscomm_impl, name, fn)
            setattr(dscomm, name, fn)
        self._originals.clear()


def cpu_rss_mb() -> float:
    """Resident set size of this process (Linux /proc), in MiB."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def peak_tflops(device_name: str) -> float | None:
    for key, tflops in PEAK_TFLOPS_BF16.items():
        if key in device_name:
            return tflops
    return None


class StepMeter:
    """Accumulates one rank's measurements between two logging steps."""

    def __init__(self, comm: CommTimer | None = None, gpu: Any = None) -> None:
        self.comm = comm
        self.gpu = gpu  # a gpuutil.GpuSampler for this rank's GPU, or None
        self.reset()
        self._step_start: float | None = None
        self._comm_start = 0.0
        self.last_step_s: float | None = None
        self.last_comm_s = 0.0  # the host's seconds inside collectives of the last step (the straggler watch)

    def reset(self) -> None:
        self.steps = 0
        self.step_s = 0.0
        self.data_s = 0.0
        self.comm_s = 0.0
        self.tokens = 0  # useful (non-padding) tokens
        self.total_tokens = 0  # every position, padding included
        self.samples = 0
        self._on_device: dict[str, Any] = {}  # counts summed on the GPU, not yet read (``settle``)

    def begin_step(self) -> None:
        if self._step_start is None:
            self._step_start = time.perf_counter()
            self._comm_start = self.comm.seconds if self.comm else 0.0
            if self.comm:
                self.comm.in_step = True

    def add_batch(self, batch: dict[str, Any], fetch_s: float) -> None:
        """Count one fetched batch; removes the collator's ``STATS_PREFIX`` keys (the model takes no such input)."""
        self.data_s += fetch_s
        stats = {k[len(STATS_PREFIX):]: batch.pop(k) for k in [k for k in batch if k.startswith(STATS_PREFIX)]}
        mask = batch.get("attention_mask")
        ids = batch["input_ids"]
        if "real_tokens" in stats:
            self.count("tokens", stats["real_tokens"])
        elif mask is not None:
            self.count("tokens", mask)
        else:
            self.tokens += int(ids.numel())
        self.total_tokens += int(ids.numel())
        if "samples" in stats:
            self.count("samples", stats["samples"])
        else:
            self.samples += int(ids.shape[0])

    def count(self, name: str, values: Any) -> None:
        """Add ``values.sum()`` to ``name``. A batch Accelerate already moved to the GPU is summed there and read at
        the next ``settle`` (a logging step): ``int()`` of a GPU sum would wait for the GPU at every step."""
        if getattr(values, "is_cuda", False):
            total = values.sum()
            held = self._on_device.get(name)
            self._on_device[name] = total if held is None else held + total
        else:
            setattr(self, name, getattr(self, name) + int(values.sum()))

    def settle(self) -> None:
        """Fold the counts still on the device into ``tokens`` / ``samples`` (one sync; the trainer's log calls it)."""
        for name, total in self._on_device.items():
            setattr(self, name, getattr(self, name) + int(total))
        self._on_device = {}

    def end_step(self) -> None:
        if self._step_start is None:
            return
        self.last_step_s = time.perf_counter() - self._step_start
        self.step_s += self.last_step_s
        if self.comm:
            self.comm.in_step = False
            self.last_comm_s = self.comm.seconds - self._comm_start
            self.comm_s += self.last_comm_s
        self.steps += 1
        self._step_start = None

    def summary(self, world_tokens: int, world_samples: int, flops_per_token: float | None = None,
                world_size: int = 1, world_total_tokens: int | None = None) -> dict[str, float]:
        """The logged values for the steps since the last summary (then reset)."""
        import torch

        out: dict[str, float] = {}
        if self.comm is not None and self.comm.cuda:
            self.comm_s += self.comm.drain_gpu_seconds()
        if self.steps and self.step_s > 0:
            out["step_time_s"] = self.step_s / self.steps
            out["tokens_per_s"] = world_tokens / self.step_s
            out["useful_tokens_per_s"] = out["tokens_per_s"]
            out["samples_per_s"] = world_samples / self.step_s
            out["data_wait_ratio"] = self.data_s / self.step_s
            if self.comm is not None:
                out["comm_wait_ratio"] = self.comm_s / self.step_s
        if world_total_tokens:
            out["useful_tokens"] = float(world_tokens)
            out["total_tokens"] = float(world_total_tokens)
            out["padding_ratio"] = 1.0 - world_tokens / world_total_tokens
        out["cpu_rss_mb"] = cpu_rss_mb()
        if torch.cuda.is_available():
            out["gpu_mem_allocated_mb"] = torch.cuda.memory_allocated() / 2**20
            out["gpu_mem_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
            out["gpu_mem_reserved_peak_mb"] = torch.cuda.max_memory_reserved() / 2**20  # + the allocator's cache: what OOMs
            peak = peak_tflops(torch.cuda.get_device_name())
            if peak and flops_per_token and "tokens_per_s" in out:
                out["mfu"] = flops_per_token * out["tokens_per_s"] / (peak * 1e12 * world_size)
        self.reset()
        return out


def flops_per_token(total_params: int, trainable_params: int) -> float:
    """Training FLOPs per token of a dense decoder: 2N forward + 2N backward (activations) + 2N_trainable
    (weight gradients). Full fine-tuning gives the usual 6N; attention's sequence term is left out."""
    return 4.0 * total_params + 2.0 * trainable_params


class MetricsFile:
    """``metrics.jsonl``: one JSON object per log call, appended and flushed (rank 0 only)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, logs: dict[str, Any]) -> None:
        row = {"step": step, "time": time.time(), **{k: v for k, v in logs.items() if isinstance(v, (int, float, str))}}
        with open_append(self.path) as fh:  # a symlink planted here is refused, never written through
            fh.write((json.dumps(row) + "\n").encode("utf-8"))
