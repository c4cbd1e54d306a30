"""Checkpoint loads that never run code: every ``torch.load`` in a training rank reads with ``weights_only=True``.

A checkpoint is a file someone may have put in a task dir or handed to ``swiftslurm import`` /
``train.resume_from``; a pickle in it can run anything on every node. transformers already loads with
``weights_only=True``; DeepSpeed does not (``TorchCheckpointEngine.load``, the universal-checkpoint loads in
``base_optimizer`` and ``zero/stage3``: ``weights_only=False``). While the trainer runs, ``torch.load`` is this
wrapper: tensors, plain containers and scalars as torch's weights-only unpickler allows them, plus the DeepSpeed
*classes* a DeepSpeed state names (``LossScaler``, ``fragment_address``, ``ZeroStageEnum``: plain records, built
by their constructors). Any other global in the pickle (a function such as ``os.system``, a class of another
package) refuses the load with one message naming the file and the global; nothing of it runs.

``weights_only_loads()`` is a context manager (the trainer enters it on its ExitStack); it restores ``torch.load``
on exit, whatever happened.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
from typing import Any, Iterator

from ...errors import CheckpointDamaged

ALLOWED_PACKAGES = ("deepspeed",)  # a class of these packages may be named by a checkpoint's pickle


def allowed_globals(names: list[str]) -> tuple[list[Any], list[str]]:
    """(the objects to allow, the names refused) for the globals a pickle names: classes of ALLOWED_PACKAGES only."""
    allowed, refused = [], []
    for name in names:
        module, _, attr = name.rpartition(".")
        obj = None
        if module.split(".")[0] in ALLOWED_PACKAGES:
            try:
                obj = getattr(importlib.import_module(module), attr, None)
            except ImportError:
                obj = None
        if inspect.isclass(obj):
            allowed.append(obj)
        else:
            refused.append(name)
    return allowed, refused


def _path_of(f: Any) -> str | None:
    return os.fspath(f) if isinstance(f, (str, os.PathLike)) else None


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    import torch
    from torch.serialization import get_unsafe_globals_in_checkpoint, safe_globals

    original = torch.load

    def load(f: Any, map_location: Any = None, pickle_module: Any = None, *, weights_only: bool | None = None,
             mmap: bool | None = None, **kwargs: Any) -> Any:
        path = _path_of(f)
        needed: list[str] = []
        if path is not None:
            try:
                needed = get_unsafe_globals_in_checkpoint(path)
            except Exception:  # noqa: BLE001 -- not a zip checkpoint: the weights-only load below says what it is
                needed = []
        allowed, refused = allowed_globals(needed)
        if refused:
            raise CheckpointDamaged(
                "a checkpoint file would run code when loaded", f"{path}: its pickle names {', '.join(refused[:3])}",
                "swiftslurm loads checkpoints with torch's weights-only unpickler (tensors, plain values and DeepSpeed's own "
                "classes); a file that needs more was not written by DeepSpeed or transformers: do not resume from it")
        with safe_globals(allowed):
            try:
                return original(f, map_location=map_location, weights_only=True, mmap=mmap, **kwargs)
            except pickle_error() as exc:
                raise CheckpointDamaged("a checkpoint file cannot be loaded without running code", f"{path or f}: {str(exc)[:300]}",
                                           "resume from a checkpoint written by DeepSpeed or transformers") from None

    torch.load = load
    try:
        yield
    finally:
        torch.load = original


def pickle_error() -> type[BaseException]:
    import pickle

    return pickle.UnpicklingError
