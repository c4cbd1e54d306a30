"""Leaving torch.distributed cleanly after a successful run, so that no rank aborts at interpreter exit.

A process that exits with a gloo process group alive can abort: a gloo worker thread
(``ProcessGroupGloo::runLoop``) still holds the last reference to the finished last collective, whose
tensors are Python objects; when it drops it during interpreter finalization it must take the GIL, CPython
ends the thread there, and the unwinding through a noexcept C++ frame calls std::terminate ("terminate
called without an active exception", SIGABRT): a rank that trained and saved fine fails its job step.

``destroy_process_group`` alone does not stop those threads: it only drops torch's own references, and a
group's threads are joined when its last reference goes. DeepSpeed keeps one: ``TorchBackend.barrier`` and
``monitored_barrier`` take ``group=torch.distributed.GroupMember.WORLD`` as a default argument, evaluated when
``deepspeed.comm.torch`` is imported, which the HF Trainer does after the default group exists. So the default
group, its two gloo workers, its transport loop and (rank 0) the TCPStore server it wraps lived until exit.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import types
from typing import Any, Iterable

log = logging.getLogger("swiftslurm.train")

# OS thread names (/proc/self/task/*/comm, 15 characters) of torch.distributed's C++ threads: gloo's workers and
# transport loop, the TCPStore server, NCCL's watchdog and heartbeat monitor
C10D_THREAD_PREFIXES = ("pt_gloo", "gloo_", "pt_tcpstore", "pt_nccl")


def shut_down_distributed() -> None:
    """After a successful run: every rank leaves together, the process groups are destroyed and every reference
    to them found in function defaults is dropped, so their threads are joined while the interpreter is alive.

    Not called after an error: a peer may still be inside a collective.
    """
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()):
        return
    tdist.barrier()
    gc.collect()  # the Trainer's reference cycles: the last Python references to the groups go now
    groups = _live_groups(tdist)
    dscomm = sys.modules.get("deepspeed.comm")
    if dscomm is not None and dscomm.is_initialized():
        dscomm.destroy_process_group()  # torch's destroy, and DeepSpeed's own references to the groups
    else:
        tdist.destroy_process_group()
    released = release_captured(groups)
    del groups  # the last references: the groups' destructors join their threads now
    gc.collect()
    left = c10d_threads()
    if left:
        log.warning("process-group threads still running after shutdown (%s; %d default argument(s) released): "
                    "this rank may abort at exit", ", ".join(left), released)


def _live_groups(tdist: Any) -> list[Any]:
    """Every process group torch knows of (the default one first)."""
    from torch.distributed import distributed_c10d

    groups = [tdist.group.WORLD]
    world = getattr(distributed_c10d, "_world", None)  # private, but the only list of the subgroups
    groups += [g for g in getattr(world, "pg_map", {}) if g is not groups[0]]
    return [g for g in groups if g is not None]


def release_captured(objects: Iterable[Any]) -> int:
    """Replace ``objects`` wherever a function holds one as a default argument value by None (torch's "the
    default group"); returns how many defaults were replaced.

    A default like ``group=GroupMember.WORLD`` is evaluated once, at definition: the function then holds that
    group for the life of the process, out of reach of ``destroy_process_group``.
    """
    ids = {id(o) for o in objects}
    if not ids:
        return 0
    replaced = 0
    for fn in gc.get_objects():
        if not isinstance(fn, types.FunctionType):
            continue
        defaults, kwdefaults = fn.__defaults__, fn.__kwdefaults__
        if defaults and any(id(v) in ids for v in defaults):
            replaced += sum(id(v) in ids for v in defaults)
            fn.__defaults__ = tuple(None if id(v) in ids else v for v in defaults)
        if kwdefaults and any(id(v) in ids for v in kwdefaults.values()):
            replaced += sum(id(v) in ids for v in kwdefaults.values())
            fn.__kwdefaults__ = {k: None if id(v) in ids else v for k, v in kwdefaults.items()}
    return replaced


def c10d_threads() -> list[str]:
    """Names of this process's torch.distributed C++ threads still running (Linux; [] where /proc is absent)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name.startswith(C10D_THREAD_PREFIXES):
            names.append(name)
    return sorted(names)
