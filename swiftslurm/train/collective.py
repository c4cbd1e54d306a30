"""The trainer's small collectives: values every rank agrees on (the walltime stop flag, the logged counts).

Only torch is imported here (``tests/test_stop_flag.py`` runs two ranks of it without transformers)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as tdist


def all_reduce_values(values: list[float], op, device, world_size: int | None = None, group=None) -> list[float]:
    """``values`` reduced over every rank (over ``group``, a gloo group, on the CPU, when given). With ``world_size``
    1 there is nothing to reduce: the values come back as they are, without the collective and the device round
    trip (a host sync) it would cost at every step."""
    if world_size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device="cpu" if group is not None else device)
    if tdist.is_available() and tdist.is_initialized():
        tdist.all_reduce(t, op=op, group=group)
    return t.tolist()


def stop_flag_group(backend: str | None = None, timeout_s: float | None = None):
    """A gloo group for the per-step stop flag when the default group is not gloo (NCCL on GPUs), else None (the
    default group already reduces on the CPU, or one rank has nothing to agree with). On NCCL the flag would be
    copied to the GPU, reduced behind the step's kernels and read back: the CPU would wait for the whole step at
    every step end instead of queueing the next one. On gloo it waits only for the other ranks' CPUs. Collective:
    every rank calls it at the same point (``ScheduleCallback.on_train_begin``)."""
    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
        return None
    if (backend or str(tdist.get_backend())) == "gloo":
        return None
    return tdist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s) if timeout_s else None)
