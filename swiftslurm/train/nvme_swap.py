"""Each job and task swaps to its own folder under the configured NVMe path, removed at exit.

``dsconfig.isolate_nvme_swap`` (pure) moves ``nvme_path`` to ``<nvme_path>/swiftslurm-<job>-<task>-<hash>``;
DeepSpeed then makes ``zero_stage_3/<dtype>params/rank<R>`` and ``optimizer/rank<R>`` below it. At exit every
rank removes its own ``rank<R>`` folders and the folders left empty, so ranks still running on the node
(or a rank of another job) never lose a file.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import dsconfig

if TYPE_CHECKING:
    from ..slurm.distenv import DistEnv


def isolate(ds_config: dict[str, Any], dist: DistEnv, output_dir: str) -> tuple[dict[str, Any], list[str]]:
    """This rank's ds config with per-job/task NVMe swap folders, and those folders."""
    name = dsconfig.nvme_swap_name(dist.job_id, dist.array_task_id, str(Path(output_dir).resolve()))
    return dsconfig.isolate_nvme_swap(ds_config, name)


def cleanup(folders: list[str], rank: int) -> None:
    """Remove this rank's swap files under ``folders`` (``rank<R>`` dirs), then every folder left empty."""
    for folder in folders:
        root = Path(folder)
        if not root.is_dir():
            continue
        for dirpath, dirs, _files in os.walk(root, topdown=True):
            if f"rank{rank}" in dirs:
                shutil.rmtree(Path(dirpath) / f"rank{rank}", ignore_errors=True)
                dirs.remove(f"rank{rank}")
        for dirpath, _dirs, _files in sorted(os.walk(root), key=lambda t: -len(t[0])):
            try:
                os.rmdir(dirpath)  # only when empty: another rank's files keep it
            except OSError:
                pass
