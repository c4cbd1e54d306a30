"""GPU utilisation of this rank's GPU, sampled through NVML (``nvidia-ml-py``) in a background thread.

NVML's utilisation rate is the share of its last sample period (1/6 s to 1 s, by GPU) in which a kernel ran.
The sampler reads it every ``interval_s`` and hands out the mean since the last read (``take``), as a fraction
0..1. Each logging step the trainer puts every rank's value into the all-reduce it already does, and rank 0 logs
the mean, the lowest and its rank (``gpu_fields``). Without a GPU, NVML or the package, nothing is sampled and the
fields are absent: never an error.
"""

from __future__ import annotations

import threading
from typing import Any

UNKNOWN = -1.0  # a rank with nothing sampled, in the all-reduced vector


def nvml_key(uuid: Any, visible: str, local_index: int) -> tuple[str, Any]:
    """How to find this rank's GPU in NVML (pure): ("uuid", "GPU-...") from torch's device uuid; else from
    CUDA_VISIBLE_DEVICES: a UUID entry, or an index; else the CUDA index itself."""
    if uuid:
        text = str(uuid)
        return ("uuid", text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}")
    entries = [e.strip() for e in visible.split(",") if e.strip()] if visible else []
    if local_index < len(entries):
        entry = entries[local_index]
        return ("uuid", entry) if entry.startswith(("GPU-", "MIG-")) else ("index", int(entry)) if entry.isdigit() else ("index", local_index)
    return ("index", local_index)


def rank_slots(own: float | None, rank: int, world_size: int) -> list[float]:
    """This rank's share of the vector all ranks sum: its mean utilisation (``UNKNOWN`` when it sampled nothing) in
    its own slot, 0 elsewhere, so the sum holds every rank's value in its slot (pure)."""
    slots = [0.0] * world_size
    slots[rank] = UNKNOWN if own is None else own
    return slots


def gpu_fields(values: list[float]) -> dict[str, float]:
    """The logged fields from every rank's mean utilisation (``UNKNOWN`` where a rank sampled nothing) (pure)."""
    known = [(v, r) for r, v in enumerate(values) if v >= 0]
    if not known:
        return {}
    low, rank = min(known)
    return {"gpu_util": sum(v for v, _ in known) / len(known), "gpu_util_min": low, "gpu_util_min_rank": float(rank)}


class GpuSampler:
    """A daemon thread reading one GPU's utilisation; ``take()`` -> the mean fraction since the last take, or None."""

    def __init__(self, read, interval_s: float = 0.5) -> None:
        self._read = read  # () -> percent 0..100
        self.interval_s = interval_s
        self._sum = 0.0
        self._count = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="swiftslurm-gpu-util", daemon=True)

    @classmethod
    def for_this_rank(cls, interval_s: float = 0.5) -> "GpuSampler | None":
        """A started sampler for the GPU this process uses, or None (no CUDA, no NVML, no nvidia-ml-py)."""
        import os

        try:
            import pynvml
            import torch

            if not torch.cuda.is_available():
                return None
            index = torch.cuda.current_device()
            uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
            pynvml.nvmlInit()
            how, key = nvml_key(uuid, os.environ.get("CUDA_VISIBLE_DEVICES", ""), index)
            handle = pynvml.nvmlDeviceGetHandleByUUID(key) if how == "uuid" else pynvml.nvmlDeviceGetHandleByIndex(key)
            pynvml.nvmlDeviceGetUtilizationRates(handle)  # readable here, or not at all
        except Exception:  # noqa: BLE001 - no GPU, no driver, a MIG slice NVML will not rate: no field, no error
            return None
        sampler = cls(lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu), interval_s)
        sampler._thread.start()
        return sampler

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                value = self._read()
            except Exception:  # noqa: BLE001 - a transient NVML error skips one sample
                continue
            with self._lock:
                self._sum += value
                self._count += 1

    def take(self) -> float | None:
        with self._lock:
            mean = self._sum / self._count / 100.0 if self._count else None
            self._sum, self._count = 0.0, 0
        return mean

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval_s + 1)
