"""A checkpoint file's contents copied off the training's path, written later with the bytes a direct save writes.

``snapshot(obj)`` copies each tensor storage the object holds once into host memory (pinned when the storage is on a
GPU, so the copy runs at the bus's speed) and deep-copies the rest of the object with each tensor swapped for a view
of its storage's copy: the same offsets, sizes and strides, storages shared as before, and every other value (strings
included) the very object the original holds, so that ``torch.save``'s pickle memo, which goes by identity, meets the
same objects. ``Snapshot.save(path)`` ``torch.save``s that copy; a storage tagger registered with
``torch.serialization.register_package`` gives each copied storage the device tag the original's had, asked of torch's
own taggers at each use as a direct save asks them (``cuda:0``, a new string each time). So the file's bytes, and the
manifest's hash of them, are those of a synchronous ``torch.save`` of the same step (tests/test_async_save.py;
benchmarks/gpu/async_bytes.py on a GPU).

Pinned host memory is slow to allocate (about 1.2 GB/s on an H100 host, against a 55 GB/s copy into it): a snapshot
copies a GPU storage into a pinned buffer of the pool when the pool has one of its size, else into pageable memory,
and ``Snapshot.wanted`` lists those sizes. The buffers of a written snapshot go back to the pool, and ``prepare(sizes)``
pins the missing ones, off the training's path (the background writer does it after the run's first save commits),
so from the second save on the copy runs at the bus's speed.

``StagedWrites`` is a DeepSpeed checkpoint engine around the run's own: ``save`` takes a snapshot and keeps it;
``write_all`` (in the background) writes them. Loads, ``create``, ``commit`` and ``makedirs`` are the wrapped engine's.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.serialization

log = logging.getLogger("swiftslurm.train")
# host copy's storage (its C pointer) -> the original's device, for the tagger below; an entry lives from the
# snapshot to the end of its write
_LOCATIONS: dict[int, torch.device] = {}
_REGISTERED = threading.Lock()
_registered = False
_POOL_LOCK = threading.Lock()
_POOL: dict[int, list[Any]] = {}  # nbytes -> pinned host storages free for the next snapshot


class _OnDevice:
    """What torch's storage taggers read of a storage: its device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device


def _tag_copy(storage) -> str | None:
    """torch's storage tagger for our host copies: the tag torch's own taggers give the device the original was on,
    asked anew at each call as for a direct save (None for any other storage)."""
    untyped = storage._untyped_storage if isinstance(storage, torch.storage.TypedStorage) else storage
    device = _LOCATIONS.get(getattr(untyped, "_cdata", None))  # type: ignore[arg-type]
    return None if device is None else torch.serialization.location_tag(_OnDevice(device))  # type: ignore[arg-type]


def _register() -> None:
    global _registered
    with _REGISTERED:
        if not _registered:
            torch.serialization.register_package(0, _tag_copy, lambda obj, location: None)  # before torch's own (10, 20)
            _registered = True


def _device_of(storage) -> torch.device:
    return storage.device


def _pooled(nbytes: int):
    """A pinned host storage of ``nbytes`` from the pool, or None."""
    with _POOL_LOCK:
        free = _POOL.get(nbytes)
        return free.pop() if free else None


def prepare(sizes: list[int]) -> float:
    """Fill the pool with pinned buffers of these sizes (those not there yet); returns the seconds it took."""
    if not torch.cuda.is_available():
        return 0.0
    start = time.perf_counter()
    with _POOL_LOCK:
        have = {n: len(v) for n, v in _POOL.items()}
    for n in sizes:
        if have.get(n, 0) > 0:
            have[n] -= 1
            continue
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True).untyped_storage()
        with _POOL_LOCK:
            _POOL.setdefault(n, []).append(host)
    return time.perf_counter() - start


def pooled_bytes() -> int:
    with _POOL_LOCK:
        return sum(n * len(v) for n, v in _POOL.items())


class Unsupported(Exception):
    """The object holds a tensor whose pickled form a host copy would not reproduce: write it synchronously."""


@dataclass
class Snapshot:
    """One file's contents: the object with host copies in place of its tensors."""

    obj: Any
    nbytes: int
    copied: list[int] = field(default_factory=list)  # the _cdata of copies tagged with their original device
    pinned: list[Any] = field(default_factory=list)  # pooled storages, back to the pool once written
    wanted: list[int] = field(default_factory=list)  # sizes of GPU storages copied to pageable memory (none pooled)

    def save(self, path: str, zipfile: bool = True) -> None:
        try:
            torch.save(self.obj, path, _use_new_zipfile_serialization=zipfile)
        finally:
            self.release()

    def release(self) -> None:
        for cdata in self.copied:
            _LOCATIONS.pop(cdata, None)
        self.copied.clear()
        self.obj = None
        with _POOL_LOCK:
            for host in self.pinned:
                _POOL.setdefault(host.nbytes(), []).append(host)
        self.pinned = []


def _plain(t: torch.Tensor) -> bool:
    """A tensor whose pickle is storage + offset + size + stride (+ requires_grad), and its attributes when it has
    some that hold no tensor (ZeRO-3 tags its flat fp32 partitions with a ``ds_id`` string): a copy pickles the same."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return False
    if t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg() or t.device.type == "meta":
        return False
    return not any(isinstance(v, torch.Tensor) for v in (getattr(t, "__dict__", None) or {}).values())


class _Null:
    def write(self, b) -> int:
        return len(b)


def _walk_tensors(obj: Any, meet) -> None:
    """Call ``meet`` on each tensor of ``obj``, walking it as torch.save's pickler will; Unsupported for a tensor whose
    pickled form a host copy would not reproduce."""

    class _Finder(pickle.Pickler):
        def reducer_override(self, o):
            if isinstance(o, torch.Tensor):
                if not _plain(o):
                    raise Unsupported(f"a {type(o).__name__} on {o.device} ({o.layout})")
                meet(o)
                return int, ()
            return NotImplemented

    _Finder(_Null(), protocol=2).dump(obj)


def gpu_storage_sizes(obj: Any) -> list[int]:
    """The sizes of the GPU storages a snapshot of ``obj`` copies, each storage once."""
    seen: dict[int, int] = {}

    def meet(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if _device_of(storage).type != "cpu":
            seen.setdefault(storage._cdata, storage.nbytes())

    _walk_tensors(obj, meet)
    return list(seen.values())


class SizeProbe:
    """A DeepSpeed checkpoint engine that writes nothing: each ``save`` records the sizes of the GPU storages a
    snapshot of it would copy, so that a save made through it learns what the pool needs (``prepare``)."""

    def __init__(self, wrapped: Any) -> None:
        self.wrapped = wrapped
        self.sizes: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)

    def save(self, state_dict: Any, path: str) -> None:
        try:
            self.sizes += gpu_storage_sizes(state_dict)
        except Unsupported:  # written synchronously when saved: nothing to pin for it
            pass


def snapshot(obj: Any) -> Snapshot:
    """``obj`` as it is now, its tensors' storages copied to host memory (see the module's docstring)."""
    _register()
    copies: dict[int, Any] = {}  # original untyped storage _cdata -> host untyped storage
    memo: dict[int, Any] = {}  # id(original tensor) -> its host copy, for deepcopy
    snap = Snapshot(None, 0)
    gpu_copies = False

    def host_copy(t: torch.Tensor) -> torch.Tensor:
        nonlocal gpu_copies
        untyped = t.untyped_storage()
        key = untyped._cdata
        if key not in copies:
            device = _device_of(untyped)
            on_gpu = device.type != "cpu"
            host = _pooled(untyped.nbytes()) if on_gpu and torch.cuda.is_available() else None
            if host is not None:
                snap.pinned.append(host)
            else:
                host = torch.empty(untyped.nbytes(), dtype=torch.uint8).untyped_storage()
                if on_gpu:
                    snap.wanted.append(untyped.nbytes())
            host.copy_(untyped, non_blocking=on_gpu)
            gpu_copies |= on_gpu
            if on_gpu:
                _LOCATIONS[host._cdata] = device
                snap.copied.append(host._cdata)
            snap.nbytes += untyped.nbytes()
            copies[key] = host
        h = torch.empty(0, dtype=t.dtype).set_(copies[key], t.storage_offset(), t.size(), t.stride())
        if isinstance(t, torch.nn.Parameter):
            h = torch.nn.Parameter(h, requires_grad=t.requires_grad)
        elif t.requires_grad:
            h.requires_grad_(True)
        if getattr(t, "__dict__", None):  # its attributes, the same objects (a string's identity counts in the pickle)
            h.__dict__.update(copy.deepcopy(t.__dict__, memo))
        return h

    def meet(o: torch.Tensor) -> None:
        if id(o) not in memo:
            memo[id(o)] = host_copy(o)

    try:
        _walk_tensors(obj, meet)
        snap.obj = copy.deepcopy(obj, memo)
    except BaseException:
        snap.release()
        raise
    if gpu_copies and torch.cuda.is_available():
        torch.cuda.synchronize()  # the non-blocking copies are done before training changes the originals
    return snap


@dataclass
class Write:
    path: str
    snap: Snapshot
    zipfile: bool
    fn: Callable[[Any], None] | None = None  # writes the restored object itself (else: torch.save to path)


class StagedWrites:
    """A DeepSpeed checkpoint engine that snapshots each ``save`` (the wrapped engine's ``torch.save``) and writes it
    in ``write_all``; everything else is the wrapped engine's. Paths are resolved when saved: the Trainer writes
    through a link that is gone by the time the background writes."""

    def __init__(self, wrapped: Any) -> None:
        self.wrapped = wrapped
        self.zipfile = bool(getattr(wrapped, "zipfile_serialization", True))
        self.pending: list[Write] = []
        self.copy_s = 0.0
        self.direct: list[str] = []  # files written at once (a tensor a copy would not reproduce)
        self.wanted: list[int] = []  # pinned buffer sizes the pool lacked for these snapshots

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)

    def save(self, state_dict: Any, path: str) -> None:
        start = time.perf_counter()
        real = os.path.realpath(path)
        try:
            snap = snapshot(state_dict)
        except Exception as exc:  # written now, as without async_save (a real fault raises there too)
            if not self.direct:
                why = exc if isinstance(exc, Unsupported) else (
                    f"no host memory for its copy ({exc})" if isinstance(exc, (MemoryError, torch.OutOfMemoryError))
                    else f"its copy failed ({type(exc).__name__}: {exc})")
                log.warning("checkpoint: %s written synchronously: %s", os.path.basename(real), why)
            self.wrapped.save(state_dict, real)
            self.direct.append(real)
        else:
            self.pending.append(Write(real, snap, self.zipfile))
        self.copy_s += time.perf_counter() - start

    def defer(self, obj: Any, write: Callable[[Any], None], what: str) -> None:
        """Snapshot ``obj`` now and call ``write`` on the copy in ``write_all`` (the Trainer's model weights, written
        by ``save_pretrained``); ``write(obj)`` at once where the snapshot fails."""
        start = time.perf_counter()
        try:
            snap = snapshot(obj)
        except Exception as exc:
            log.warning("checkpoint: %s written synchronously: its copy failed (%s: %s)", what, type(exc).__name__, exc)
            write(obj)
            self.direct.append(what)
        else:
            self.pending.append(Write(what, snap, True, write))
        self.copy_s += time.perf_counter() - start

    @property
    def nbytes(self) -> int:
        return sum(w.snap.nbytes for w in self.pending)

    def write_all(self, after_first: Callable[[], None] | None = None) -> None:
        """Write every snapshot, in order; ``after_first`` runs once the first is written (a test's crash point)."""
        first = True
        while self.pending:
            write = self.pending.pop(0)
            self.wanted += write.snap.wanted
            if write.fn is None:
                write.snap.save(write.path, write.zipfile)
            else:
                try:
                    write.fn(write.snap.obj)
                finally:
                    write.snap.release()
            if first and after_first is not None:
                after_first()
            first = False

    def prepare_next(self) -> float:
        """Pin the buffers these snapshots lacked, for the next save (after this one's commit); the seconds it took."""
        wanted, self.wanted = self.wanted, []
        return prepare(wanted) if wanted else 0.0

    def drop(self) -> None:
        for write in self.pending:
            write.snap.release()
        self.pending.clear()
