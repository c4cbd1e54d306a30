"""A checkpoint file's contents copied off the training's path, written later with the bytes a direct save writes.

``snapshot(obj)`` pickles the object's structure now (its plain values as they are at this step) and copies each
tensor storage it meets once into host memory (pinned when the storage is on a GPU, so the copy runs at the bus's
speed), keeping which tensors share a storage. ``Snapshot.save(path)`` rebuilds the object from those copies and
``torch.save``s it: the same pickled structure, the same storages in the same order, and, through a storage tagger
registered with ``torch.serialization.register_package``, the same device tag for each storage as the original had
(``cuda:0`` for a copy of a GPU storage). So the file's bytes, and the manifest's hash of them, are those of a
synchronous ``torch.save`` of the same step (tests/test_async_save.py compares them).

``StagedWrites`` is a DeepSpeed checkpoint engine around the run's own: ``save`` takes a snapshot and keeps it;
``write_all`` (in the background) writes them. Loads, ``create``, ``commit`` and ``makedirs`` are the wrapped engine's.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.serialization

log = logging.getLogger("swiftslurm.train")
# host copy's storage (its C pointer) -> the original's device tag, for the tagger below; an entry lives from the
# snapshot to the end of its write
_LOCATIONS: dict[int, str] = {}
_REGISTERED = threading.Lock()
_registered = False


def _tag_copy(storage) -> str | None:
    """torch's storage tagger for our host copies: the device the copied storage was on (None for any other)."""
    untyped = storage._untyped_storage if isinstance(storage, torch.storage.TypedStorage) else storage
    return _LOCATIONS.get(untyped._cdata)


def _register() -> None:
    global _registered
    with _REGISTERED:
        if not _registered:
            torch.serialization.register_package(0, _tag_copy, lambda obj, location: None)  # before torch's own (10, 20)
            _registered = True


class Unsupported(Exception):
    """The object holds a tensor whose pickled form a host copy would not reproduce: write it synchronously."""


@dataclass
class Snapshot:
    """One file's contents: the pickled structure and the host copies of its storages, by pickled id."""

    structure: bytes
    storages: list[Any]  # typed storages on the host
    nbytes: int
    copied: list[int] = field(default_factory=list)  # the _cdata of copies tagged with their original device

    def restore(self) -> Any:
        storages = self.storages

        class _Unpickler(pickle.Unpickler):
            def persistent_load(self, pid):
                return storages[int(pid)]

        return _Unpickler(io.BytesIO(self.structure)).load()

    def save(self, path: str, zipfile: bool = True) -> None:
        try:
            torch.save(self.restore(), path, _use_new_zipfile_serialization=zipfile)
        finally:
            self.release()

    def release(self) -> None:
        for cdata in self.copied:
            _LOCATIONS.pop(cdata, None)
        self.copied.clear()
        self.storages = []


def _plain(t: torch.Tensor) -> bool:
    """A tensor whose pickle is storage + offset + size + stride (+ requires_grad): a copy pickles the same."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return False
    if t.layout != torch.strided or t.is_quantized or t.is_conj() or t.is_neg() or t.device.type == "meta":
        return False
    return not getattr(t, "__dict__", None)


def snapshot(obj: Any) -> Snapshot:
    """``obj`` as it is now, its tensors' storages copied to host memory (see the module's docstring)."""
    _register()
    copies: dict[int, tuple[int, Any]] = {}  # original untyped storage _cdata -> (pickled id, host typed storage)
    order: list[Any] = []
    tagged: list[int] = []
    nbytes = 0

    class _Pickler(pickle.Pickler):
        def reducer_override(self, o):
            if isinstance(o, torch.Tensor) and not _plain(o):
                raise Unsupported(f"a {type(o).__name__} on {o.device} ({o.layout})")
            return NotImplemented

        def persistent_id(self, o):
            nonlocal nbytes
            if not isinstance(o, (torch.storage.TypedStorage, torch.UntypedStorage)):
                return None
            typed = o if isinstance(o, torch.storage.TypedStorage) else None
            untyped = typed._untyped_storage if typed is not None else o
            key = untyped._cdata
            if key not in copies:
                gpu = untyped.device.type != "cpu"
                host = torch.empty(untyped.nbytes(), dtype=torch.uint8, pin_memory=gpu and torch.cuda.is_available()).untyped_storage()
                host.copy_(untyped, non_blocking=gpu)
                if gpu:
                    _LOCATIONS[host._cdata] = torch.serialization.location_tag(untyped)
                    tagged.append(host._cdata)
                nbytes += untyped.nbytes()
                copy = torch.storage.TypedStorage(wrap_storage=host, dtype=typed.dtype, _internal=True) if typed is not None else host
                copies[key] = (len(order), copy)
                order.append(copy)
            return str(copies[key][0])

    buf = io.BytesIO()
    try:
        _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    except BaseException:
        for cdata in tagged:
            _LOCATIONS.pop(cdata, None)
        raise
    if tagged and torch.cuda.is_available():
        torch.cuda.synchronize()  # the non-blocking copies are done before training changes the originals
    return Snapshot(buf.getvalue(), order, nbytes, tagged)


@dataclass
class Write:
    path: str
    snap: Snapshot
    zipfile: bool


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

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)

    def save(self, state_dict: Any, path: str) -> None:
        start = time.perf_counter()
        real = os.path.realpath(path)
        try:
            snap = snapshot(state_dict)
        except (Unsupported, MemoryError, torch.OutOfMemoryError) as exc:  # written now, as without async_save
            if not self.direct:
                log.warning("checkpoint: %s written synchronously: %s", os.path.basename(real),
                            exc if isinstance(exc, Unsupported) else f"no host memory for its copy ({exc})")
            self.wrapped.save(state_dict, real)
            self.direct.append(real)
        else:
            self.pending.append(Write(real, snap, self.zipfile))
        self.copy_s += time.perf_counter() - start

    @property
    def nbytes(self) -> int:
        return sum(w.snap.nbytes for w in self.pending)

    def write_all(self) -> None:
        while self.pending:
            write = self.pending.pop(0)
            write.snap.save(write.path, write.zipfile)

    def drop(self) -> None:
        for write in self.pending:
            write.snap.release()
        self.pending.clear()
