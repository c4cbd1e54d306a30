"""Per-rank logging and the rank-0 startup banner.

Rank 0 logs to stderr (the Slurm output file) and prints the banner; every other rank logs to
``<output_dir>/logs/rank-<r>.log``, so a hang can be traced to the rank that stopped talking.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import hostlist

from ..fsutil import open_append_text
from ..slurm.distenv import DistEnv
from ..taskdir import TaskPaths

if TYPE_CHECKING:
    from ..spec.model import JobSpec

LOGGER = "swiftslurm.runtime"
TRAIN_LOGGER = "swiftslurm.train"


def rank_log_path(output_dir: str, rank: int) -> Path:
    return TaskPaths(output_dir).rank_log(rank)


def _drop_own_handlers(log: logging.Logger) -> None:
    for handler in list(log.handlers):
        if getattr(handler, "_swiftslurm", False):
            log.removeHandler(handler)
            handler.close()


def setup_logging(dist: DistEnv, output_dir: str) -> logging.Logger:
    """The runtime's logger for this rank (idempotent: a rerun in the same process replaces handlers).

    The trainer's logger (``swiftslurm.train``) writes to stderr with the same prefix: its INFO lines (pruned
    checkpoints, ...) on rank 0, only its warnings on the other ranks (their stderr, as before)."""
    fmt = logging.Formatter(f"%(asctime)s [rank {dist.rank} {dist.node}] %(levelname)s %(message)s")
    train = logging.getLogger(TRAIN_LOGGER)
    _drop_own_handlers(train)
    stream = logging.StreamHandler(sys.stderr)
    stream._swiftslurm = True  # type: ignore[attr-defined]
    stream.setFormatter(fmt)
    train.addHandler(stream)
    train.setLevel(logging.INFO if dist.rank == 0 else logging.WARNING)
    train.propagate = False

    log = logging.getLogger(LOGGER)
    _drop_own_handlers(log)
    if dist.rank == 0:
        handler: logging.Handler = logging.StreamHandler(sys.stderr)
    else:
        path = rank_log_path(output_dir, dist.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.StreamHandler(open_append_text(path))  # refuses a symlink or FIFO there (FileHandler follows)
    handler._swiftslurm = True  # type: ignore[attr-defined]
    handler.setFormatter(fmt)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    return log


def enable_stack_dumps(dist: DistEnv, output_dir: str) -> None:
    """SIGUSR1 dumps this rank's Python stacks into its log (rank 0: stderr), so
    `scancel --signal=USR1 JOB` shows where every rank of a hung job stands."""
    import faulthandler
    import signal

    if dist.rank == 0:
        target = sys.stderr
    else:
        target = open_append_text(rank_log_path(output_dir, dist.rank))  # kept open: faulthandler writes to its fd
    try:
        faulthandler.register(signal.SIGUSR1, file=target, all_threads=True, chain=False)
    except (ValueError, RuntimeError, OSError):  # not a real file (captured stderr): no dumps
        pass


def container_row(container, env: Mapping[str, str]) -> str:
    """The container line of the banner (pure): runtime, image, its digest when pinned, and what the rank sees."""
    image = container.image
    _, at, digest = image.partition("@")
    shown = f"{container.runtime} {image}"
    shown += f" (digest {digest})" if at and digest.startswith("sha256:") else " (no digest pinned: IMAGE@sha256:... pins one)"
    inside = env.get("APPTAINER_CONTAINER") or env.get("SINGULARITY_CONTAINER")
    if inside:
        shown += f"; this rank runs in {inside}"
    return shown


def banner_rows(dist: DistEnv, spec: JobSpec, output_dir: str, mode: str, resume: str, env: Mapping[str, str] | None = None,
                decisions: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """What the banner shows, as (label, value) rows (pure; ``env`` is the rank's environment; ``decisions``: what
    ``plan`` resolved from "auto", key -> why)."""
    trains = spec.has_training and not spec.train.command
    ckpt = spec.train.gradient_checkpointing
    why = (decisions or {}).get("train.gradient_checkpointing") or \
        ("on (auto)" if ckpt == "auto" else f"{'on' if ckpt else 'off'} (set in the spec)")
    if ckpt is True and spec.train.gradient_checkpointing_layers and "train.gradient_checkpointing" not in (decisions or {}):
        why += f", the first {spec.train.gradient_checkpointing_layers} layers"
    saving = spec.checkpoint.async_save
    saves = (decisions or {}).get("checkpoint.async_save") or \
        ("off (auto)" if saving == "auto" else f"{'on' if saving else 'off'} (set in the spec)")
    job = dist.requeue_id + (f" (restart {dist.restart_count})" if dist.restart_count else "")
    what = " ".join(spec.train.command) if spec.train.command else f"{spec.train.model} ({spec.train.train_type})"
    if not spec.has_training:
        what = "- (no [train]: preflight only)"
    return [
        ("job", f"{spec.job.name} {job} [{dist.executor}]"),
        ("nodes", f"{hostlist.collect_hostlist(list(dist.nodes))} ({dist.nnodes})"),
        ("world size", f"{dist.world_size} = {dist.nnodes} node(s) x {dist.local_world_size} rank(s)"),
        ("master", f"{dist.master_addr}:{dist.master_port}"),
        ("gpus", ",".join(dist.gpus) if dist.gpus else "none (CPU, gloo)"),
        ("mode", mode),
        ("runs", what),
        ("deepspeed", spec.train.deepspeed if trains else "-"),
        *([("gradient checkpointing", why), ("background saves", saves)] if trains else []),
        ("resume from", resume),
        ("output", output_dir),
        *([("container", container_row(spec.container, env or {}))] if getattr(spec, "container", None) is not None else []),
        ("python", sys.executable),
    ]


def print_banner(dist: DistEnv, spec: JobSpec, output_dir: str, mode: str, resume: str,
                 decisions: Mapping[str, str] | None = None) -> None:
    """Rank 0 only: a rich table on stderr."""
    if dist.rank != 0:
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title="swiftslurm run", show_header=False, title_justify="left")
    table.add_column(style="bold cyan")
    table.add_column()
    for label, value in banner_rows(dist, spec, output_dir, mode, resume, os.environ, decisions):
        table.add_row(label, Text(value))  # values are user text: no markup
    Console(stderr=True, width=120).print(table, markup=False, highlight=False)
