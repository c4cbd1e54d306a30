"""How a rank is started, for both submit paths (pure): the interpreter, the container wrapping, setup lines.

The rendered script and the submitit path start every rank as
``srun [SRUN_ARGS] [PREFIX...] PYTHON -m ...``; this module says what SRUN_ARGS, PREFIX and PYTHON are:

- no container: no extra srun args, no prefix; PYTHON = ``slurm.python`` or the submitting interpreter;
- pyxis: ``--container-image/--container-mounts/--container-workdir/--container-writable/--container-env``
  on srun; PYTHON = ``slurm.python`` or ``python3`` (the image's);
- apptainer: PREFIX = ``apptainer exec [--nv] --bind ... [--pwd DIR] [--writable-tmpfs] IMAGE``.

The output dir (which holds the plan, the task dirs and submitit's folder) is mounted at the same path
in both runtimes. ``slurm.setup`` lines are the user's shell, written verbatim (validated one line each).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import PurePosixPath

from ..plan import Group, Plan
from ..quoting import shell_quote

CONTAINER_PYTHON = "python3"  # the image's interpreter when slurm.python is unset


@dataclass(frozen=True)
class Launch:
    srun_args: tuple[str, ...]  # extra srun options (pyxis)
    prefix: tuple[str, ...]  # argv before the interpreter (apptainer exec ... IMAGE)
    python: str  # the interpreter the ranks run

    def command(self) -> str:
        """``PREFIX... PYTHON`` as one shell-quoted string (submitit's ``python=``, the script's srun line)."""
        return " ".join(shell_quote(a) for a in (*self.prefix, self.python))


def _covered(path: str, mounts: list[str]) -> bool:
    """A mount already puts host ``path`` at the same path inside (``/scratch:/scratch`` covers /scratch/x)."""
    p = PurePosixPath(path)
    for m in mounts:
        src, dst = m.split(":")[:2]
        if src == dst and (PurePosixPath(src) == p or PurePosixPath(src) in p.parents):
            return True
    return False


def mounts_of(plan: Plan) -> list[str]:
    """The container's mounts: the spec's, plus the output dir at its own path unless one covers it."""
    c = plan.container
    mounts = list(c.mounts) if c is not None else []
    if not _covered(plan.output_dir, mounts):
        mounts.append(f"{plan.output_dir}:{plan.output_dir}")
    return mounts


def launch_for(plan: Plan, group: Group, default_python: str | None = None) -> Launch:
    """What starts each rank of ``group`` (pure). ``default_python``: when slurm.python is unset (default: this one)."""
    c = plan.container
    python = group.slurm.python or (CONTAINER_PYTHON if c is not None else (default_python or sys.executable))
    if c is None:
        return Launch((), (), python)
    mounts = mounts_of(plan)
    if c.runtime == "pyxis":
        args = [f"--container-image={c.image}", f"--container-mounts={','.join(mounts)}"]
        if c.workdir:
            args.append(f"--container-workdir={c.workdir}")
        if c.writable:
            args.append("--container-writable")
        if c.env:
            args.append(f"--container-env={','.join(c.env)}")
        return Launch(tuple(args), (), python)
    prefix = ["apptainer", "exec"]
    if group.slurm.gpus_per_node > 0:
        prefix.append("--nv")
    for m in mounts:
        prefix += ["--bind", m]
    if c.workdir:
        prefix += ["--pwd", c.workdir]
    if c.writable:
        prefix.append("--writable-tmpfs")
    prefix.append(c.image)
    return Launch((), tuple(prefix), python)


def passthrough_lines(plan: Plan) -> list[str]:
    """Apptainer: ``container.env`` names whose host values override the image's (APPTAINERENV_NAME), if set."""
    c = plan.container
    if c is None or c.runtime != "apptainer":
        return []  # pyxis takes them as --container-env
    return [f'if [ -n "${{{name}+x}}" ]; then export APPTAINERENV_{name}="${name}"; fi' for name in c.env]


def setup_lines(plan: Plan, group: Group) -> list[str]:
    """The batch script's lines before the ranks start: [env] exports, the user's setup lines, container env."""
    exports = [f"export {name}={shell_quote(value)}" for name, value in plan.env.items()]
    return [*exports, *group.slurm.setup, *passthrough_lines(plan)]
