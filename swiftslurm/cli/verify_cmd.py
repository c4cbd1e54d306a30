"""`swiftslurm verify PATH`: a table of checkpoints, verified or not, naming what is damaged.

PATH is one checkpoint dir, a task output dir holding ``checkpoint-N`` dirs, or a job output dir whose
array tasks each have their own (``<output_dir>/<task>/checkpoint-N``). Exit 5 when the newest
checkpoint (of any task) is damaged, 0 otherwise.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from .. import checkpoint as ck
from ..errors import CheckpointDamaged, SwiftSlurmError
from ..fsutil import DIRECTORY, MISSING, path_kind

PROGRESS_MIN_BYTES = 256 << 20  # show a progress bar for checkpoints at least this large


def _groups(path: Path) -> dict[Path, list[Path]]:
    """{output dir: its checkpoints, newest first} for whatever PATH the user gave."""
    if (path / ck.MANIFEST_NAME).exists() or ck.step_of(path) is not None or path.name.startswith(".staging-"):
        return {path.parent: [path]}
    found = {path: ck.list_checkpoints(path)} if ck.list_checkpoints(path) else {}
    if not found:
        for sub in sorted(p for p in path.iterdir() if p.is_dir()):
            if ck.list_checkpoints(sub):
                found[sub] = ck.list_checkpoints(sub)
    return found


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _manifest_bytes(ckpt: Path) -> int:
    try:
        return ck.read_manifest(ckpt).total_bytes
    except ck.ManifestError:
        return 0


def _verify_one(console: Console, ckpt: Path) -> ck.VerifyResult:
    total = _manifest_bytes(ckpt)
    if total < PROGRESS_MIN_BYTES or not console.is_terminal:
        return ck.verify(ckpt)
    columns = (TextColumn(f"verifying {escape(ckpt.name)}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as bar:
        task = bar.add_task("verify", total=total)
        return ck.verify(ckpt, progress=lambda done, _total: bar.update(task, completed=done))


def verify_command(console: Console, path: Path) -> int:
    path = Path(path)
    kind = path_kind(path)
    if kind == MISSING:
        raise SwiftSlurmError(
            "nothing to verify: the path does not exist",
            str(path),
            "give a checkpoint directory (checkpoint-N) or the job's output_dir",
        )
    if kind != DIRECTORY:
        raise SwiftSlurmError("nothing to verify: not a directory", f"{path}: {kind}", "give a checkpoint directory or an output dir")
    groups = _groups(path)
    if not groups:
        console.print(f"no checkpoints under {escape(str(path))} (looked for checkpoint-N directories)", highlight=False)
        return 0

    table = Table(title=f"checkpoints under {escape(str(path))}", title_justify="left")
    for col in ("checkpoint", "step", "files", "size", "algo", "status"):
        table.add_column(col, no_wrap=col != "checkpoint", overflow="fold")
    table.add_column("what is wrong", overflow="fold", min_width=30)
    damaged_newest: list[ck.VerifyResult] = []
    resume_from: dict[Path, Path | None] = {}
    for out, ckpts in groups.items():
        resume_from[out] = None
        for i, ckpt in enumerate(ckpts):
            r = _verify_one(console, ckpt)
            name = str(ckpt.relative_to(path)) if ckpt != path and path in ckpt.parents else ckpt.name
            m = r.manifest
            table.add_row(
                escape(name),
                str(r.step if r.step is not None else "?"),
                str(len(m.files)) if m else "-",
                _size(m.total_bytes) if m else "-",
                m.algo if m else "-",
                "[green]verified[/]" if r.ok else "[bold red]DAMAGED[/]",
                escape("\n".join(r.problems)),
            )
            if r.ok and resume_from[out] is None:
                resume_from[out] = ckpt
            if i == 0 and not r.ok:
                damaged_newest.append(r)
    console.print(table)
    single = len(groups) == 1 and next(iter(groups.values())) == [path]
    for out, newest in ([] if single else resume_from.items()):
        where = escape(str(out))
        if newest is None:
            console.print(f"{where}: no verified checkpoint; a run would start from scratch", highlight=False)
        else:
            console.print(f"{where}: a run resumes from [bold]{escape(newest.name)}[/]", highlight=False)
    if damaged_newest:
        first = damaged_newest[0]
        raise CheckpointDamaged(
            f"the newest checkpoint is damaged: {first.path}",
            "; ".join(first.problems[:3]) + (f" (and {len(first.problems) - 3} more)" if len(first.problems) > 3 else ""),
            "resume skips it and uses the newest verified one listed above; delete the damaged dir once inspected",
        )
    return 0
