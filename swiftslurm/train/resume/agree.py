"""The trainer's side of the resume decision: ``checkpoint.agree_resume_point`` over its process group.

Called once the process group exists (``TrainingArguments.device`` initializes it), before the model
loads a checkpoint: rank 0 lists, every rank hashes a share of each candidate, one verdict; every rank
checks it can read the chosen one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ... import checkpoint as ck


class ProcessGroupExchange:
    """``checkpoint.ranks.agree.Exchange`` over the default torch.distributed process group (gloo or NCCL)."""

    def broadcast(self, obj: Any) -> Any:
        import torch.distributed as tdist

        box = [obj]
        tdist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        import torch.distributed as tdist

        out: list[Any] = [None] * tdist.get_world_size()
        tdist.all_gather_object(out, obj)
        return out


def world_size() -> int:
    import torch.distributed as tdist

    return tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1


def exchange() -> "ck.Exchange":
    return ProcessGroupExchange() if world_size() > 1 else ck.SingleRank()


def agreed_resume_point(output_dir: str, rank: int, node: str, log: Callable[[str], None] = print) -> str | None:
    """The newest verified checkpoint under ``output_dir``, as rank 0 lists it, hashed by every rank (each a
    share, ``checkpoint.verified_split``), then checked readable by every rank."""
    ex = exchange()
    chosen = ck.verified_split(output_dir, rank, world_size(), node, ex, log)
    found = ck.agree_resume_point(output_dir, rank, node, ex, lambda: chosen, log)
    return str(found) if found is not None else None


def resolve(resume_from: str | bool | None, output_dir: str, rank: int, node: str) -> str | None:
    """``True``: the agreed newest verified checkpoint; a path: that checkpoint, checked by every rank; None: fresh."""
    if resume_from is True:
        return agreed_resume_point(output_dir, rank, node)
    if not resume_from:
        return None
    found = ck.agree_resume_point(output_dir, rank, node, exchange(), lambda: Path(str(resume_from)), print)
    return str(found)
