"""One resume point for every rank: rank 0 decides, every rank checks it can read it, one verdict.

When each rank picked its own newest verified checkpoint, a stale listing of the output dir on one node
(a shared filesystem's directory cache) or a read error there made ranks resume from different steps:
silent divergence, or a hang in the first collective. Here only rank 0 lists and verifies; it sends the
checkpoint's name to every rank, each rank checks the checkpoint by that path (directory, manifest,
the sizes of the files it will load itself), and every rank learns every verdict. If one rank cannot read
it, every rank raises the same error naming that rank and its node, so the job stops instead of diverging.

The transport is an ``Exchange`` (``train.resume`` wraps the trainer's torch.distributed process group);
this module never imports torch.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Callable, Protocol

from ...errors import CheckpointUnreadable
from ..manifest import ManifestError, describe_os_error, file_kind, read_manifest
from ..names import owner_rank, step_of


class Exchange(Protocol):
    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""


class SingleRank:
    """The exchange of a job of one rank."""

    def broadcast(self, obj: Any) -> Any:
        return obj

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]


def files_of_rank(files: dict[str, Any], rank: int) -> list[str]:
    """The manifest entries rank ``rank`` loads: its own per-rank files and every shared one (pure)."""
    return sorted(rel for rel in files if owner_rank(rel) in (None, rank))


def readable_problem(ckpt: Path | str, rank: int) -> str | None:
    """Why this rank cannot read checkpoint ``ckpt`` (by path, not by listing), or None when it can:
    the directory exists, its manifest reads and matches its name, and the files this rank loads are
    regular files of the listed sizes. Stats only, no hashing: rank 0 verified the content."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        return f"{ckpt}: not a directory (missing here)"
    try:
        manifest = read_manifest(ckpt)
    except ManifestError as exc:
        return f"{ckpt.name}/manifest.json: {exc}"
    if step_of(ckpt) is not None and step_of(ckpt) != manifest.step:
        return f"{ckpt.name}/manifest.json: says step {manifest.step}"
    for rel in files_of_rank(manifest.files, rank):
        path = ckpt / rel
        try:
            st = os.stat(path)
        except OSError as exc:
            return f"{ckpt.name}/{rel}: {'missing' if isinstance(exc, FileNotFoundError) and not os.path.islink(path) else describe_os_error(path, exc)}"
        if not stat.S_ISREG(st.st_mode):
            return f"{ckpt.name}/{rel}: {file_kind(st.st_mode)}, not a regular file"
        if st.st_size != int(manifest.files[rel]["size"]):
            return f"{ckpt.name}/{rel}: size {st.st_size} bytes, manifest says {manifest.files[rel]['size']}"
    return None


def undecided(error: str) -> CheckpointUnreadable:
    """The error every rank raises when rank 0 could not list the output dir (``error`` says why)."""
    return CheckpointUnreadable(
        "rank 0 could not choose a checkpoint to resume from",
        error,
        "check that job.output_dir is readable on the first node; `swiftslurm verify OUTPUT_DIR` shows every checkpoint",
    )


def unreadable_by(bad: list[dict[str, Any]], chosen: Path | None) -> CheckpointUnreadable:
    """The error every rank raises when the ranks of ``bad`` (verdicts ``{rank, node, problem}``) cannot read
    ``chosen``, the checkpoint rank 0 saw whole."""
    first = bad[0]
    more = f" (and {len(bad) - 1} more rank(s): " + ", ".join(f"rank {v['rank']} on {v['node']}" for v in bad[1:4]) + ")" if len(bad) > 1 else ""
    return CheckpointUnreadable(
        f"rank {first['rank']} on node {first['node']} cannot read the resume point {chosen.name if chosen else '?'} "
        f"that rank 0 chose{more}",
        first["problem"],
        f"every node must see job.output_dir alike (one shared filesystem, mounted on every node): check the mount "
        f"on {first['node']}; to resume from an older checkpoint instead, move {chosen} aside",
    )


def agree_resume_point(
    output_dir: Path | str,
    rank: int,
    node: str,
    exchange: Exchange,
    decide: Callable[[], Path | None],
    log: Callable[[str], None] = print,
) -> Path | None:
    """The checkpoint every rank resumes from (None: a fresh start), the same on every rank.

    Rank 0 calls ``decide()`` (e.g. ``newest_verified``) and broadcasts the result; each rank checks it
    with ``readable_problem``; the verdicts are all-gathered. Raises ``CheckpointUnreadable`` on every
    rank when rank 0 could not decide or any rank cannot read the chosen checkpoint.
    """
    decision: dict[str, Any] = {"path": None, "error": None}
    if rank == 0:
        try:
            found = decide()
            decision["path"] = str(found) if found is not None else None
        except OSError as exc:  # e.g. the output dir cannot be listed: the other ranks must not wait on us
            decision["error"] = f"{output_dir}: {exc}"
    decision = exchange.broadcast(decision)
    if decision["error"]:
        raise undecided(decision["error"])
    chosen = Path(decision["path"]) if decision["path"] else None
    problem = readable_problem(chosen, rank) if chosen is not None and rank != 0 else None
    verdicts = exchange.all_gather({"rank": rank, "node": node, "problem": problem})
    bad = [v for v in verdicts if v["problem"]]
    if bad:
        raise unreadable_by(bad, chosen)
    if rank == 0:
        log(f"swiftslurm: every rank ({len(verdicts)}) resumes from {chosen}" if chosen else
            f"swiftslurm: no verified checkpoint under {output_dir}: every rank ({len(verdicts)}) starts fresh")
    return chosen
