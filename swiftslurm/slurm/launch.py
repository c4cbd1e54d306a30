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

import re
import sys
from dataclasses import dataclass
from pathlib import PurePosixPath

from ..errors import Problem, SpecError
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


LIST_SEPARATORS = (":", ",")  # pyxis --container-mounts and apptainer --bind: SRC:DST[:FLAGS], comma-separated


def _read_only(flags: str | None) -> bool:
    return bool(flags) and "ro" in re.split(r"[+,:]", flags or "")


def _innermost(path: str, mounts: list[str]) -> tuple[str, str, str | None] | None:
    """The mount that decides what ``path`` is inside the container: the deepest destination holding it."""
    p = PurePosixPath(path)
    best: tuple[str, str, str | None] | None = None
    for m in mounts:
        src, dst, *flags = m.split(":")
        d = PurePosixPath(dst)
        if (d == p or d in p.parents) and (best is None or len(d.parts) > len(PurePosixPath(best[1]).parts)):
            best = (src, dst, flags[0] if flags else None)
    return best


def _covered(path: str, mounts: list[str]) -> bool:
    """A mount already puts host ``path`` at the same path inside (``/scratch:/scratch`` covers /scratch/x), and no
    deeper mount puts something else there."""
    best = _innermost(path, mounts)
    return best is not None and PurePosixPath(best[0]) == PurePosixPath(best[1])


def _problem(path: str, what: str, found: str, hint: str) -> SpecError:
    return SpecError("spec", [Problem(path, what, found, hint)])


def mounts_of(plan: Plan) -> list[str]:
    """The container's mounts: the spec's, plus the output dir at its own path unless one covers it.

    SpecError where the ranks could not write their output dir: a path that would break the runtime's mount
    list (``:`` or ``,`` in it), or a read-only mount over the output dir.
    """
    c = plan.container
    mounts = list(c.mounts) if c is not None else []
    out = plan.output_dir
    best = _innermost(out, mounts)
    if best is not None and _read_only(best[2]):
        raise _problem("container.mounts", "a read-only mount covers the output dir: the ranks write their checkpoints, "
                       "logs and metrics there", f"{best[0]}:{best[1]}:{best[2]} over job.output_dir {out}",
                       "mount that path read-write (drop ':ro'), or choose a job.output_dir outside it")
    if not _covered(out, mounts):
        bad = [ch for ch in LIST_SEPARATORS if ch in out]
        if bad:
            raise _problem("job.output_dir", f"the output dir is mounted into the container, and {' and '.join(repr(b) for b in bad)} "
                           f"in it would break the {c.runtime if c else 'container'} mount list (SRC:DST[:FLAGS], comma-separated)",
                           out, "choose a job.output_dir without ':' or ','")
        mounts.append(f"{out}:{out}")
    for m in mounts:  # the spec's own are checked in the model; this holds for every entry that reaches the list
        parts = m.split(":")
        if "," in m or len(parts) not in (2, 3) or not all(parts[:2]):
            raise _problem("container.mounts", "a mount that the runtime's mount list cannot carry", m,
                           "each mount as SRC:DST or SRC:DST:FLAGS, without ',' and with no ':' inside a path")
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


def supervisor_for(plan: Plan, group: Group, default_python: str | None = None, tasks: tuple[int, ...] | None = None) -> str:
    """``PYTHON -m swiftslurm.node.batch.supervise --plan PLAN [--tasks LIST] --``, shell-quoted, for a group with
    ``slurm.max_restarts > 0`` ('' without): what stands in front of the training srun in the batch script.

    It runs on the batch host, outside any container: ``slurm.python`` (or this interpreter) without one, this
    interpreter with one. ``tasks``: the submitit path's array, whose SLURM_ARRAY_TASK_ID counts 0..n-1 over them.
    """
    if not group.slurm.max_restarts:
        return ""
    python = (group.slurm.python if plan.container is None else None) or default_python or sys.executable
    argv = [python, "-m", "swiftslurm.node.batch.supervise", "--plan", plan.plan_path]
    if tasks is not None:
        argv += ["--tasks", ",".join(map(str, tasks))]
    return " ".join(shell_quote(a) for a in [*argv, "--"])


def supervisor_setup(plan: Plan, group: Group, tasks: tuple[int, ...]) -> list[str]:
    """The submitit path, whose script runs its own ``srun ...`` line: a shell function named ``srun`` (defined
    after the user's setup lines) hands that line to the supervisor. [] without ``slurm.max_restarts``."""
    prefix = supervisor_for(plan, group, tasks=tasks)
    if not prefix:
        return []
    return ["# slurm.max_restarts: the training step runs under the in-job restart supervisor",
            f'srun() {{ {prefix} srun "$@"; }}']
