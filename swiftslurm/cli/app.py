"""The command line: the only place errors become rich output and exit codes.

Each command is thin: it calls library code (which raises typed SwiftSlurmError with a hint)
and prints. A user mistake never shows a Python traceback unless --debug is given.
"""

from __future__ import annotations

import json
import os
import sys
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from .. import __version__
from ..checkpoint.manifest import refuse_inside_sealed
from ..errors import SwiftSlurmError
from ..fsutil import MISSING, Unwritable, check_named_file, path_kind, write_named_file

app = typer.Typer(
    name="swiftslurm",
    help="One TOML job spec to multi-node DeepSpeed fine-tuning on Slurm: validate, plan, submit, "
    "preflight, verify. Start with `swiftslurm validate examples/quickstart.toml`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)
_state = {"debug": False}

class ExecutorName(str, Enum):
    auto = "auto"
    slurm = "slurm"
    local = "local"


Executor = typer.Option(
    ExecutorName.auto, "--executor", "-e", help="auto (Slurm if sbatch is on PATH, else local), slurm, or local."
)


MaxArraySize = typer.Option(
    None, "--max-array-size", min=1, envvar="SWIFTSLURM_MAX_ARRAY_SIZE",
    help="The site's MaxArraySize (`scontrol show config`): show/write the sweep split into arrays that fit. "
    "`submit` reads it from the cluster itself.",
)


def _limits(max_array_size: Optional[int]):
    from ..plan import ArrayLimits

    return ArrayLimits(max_array_size) if max_array_size is not None else None


def _version(value: bool) -> None:
    if value:
        console.print(f"swiftslurm {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
    debug: bool = typer.Option(False, "--debug", help="Show Python tracebacks for errors (for bug reports)."),
) -> None:
    _state["debug"] = debug or os.environ.get("SWIFTSLURM_DEBUG") == "1"


def print_error(exc: SwiftSlurmError) -> None:
    from ..errors import SpecError

    # every text of an error may carry user strings (paths, values, Slurm's words): escaped, never read as markup
    if isinstance(exc, SpecError):
        err_console.print(f"[bold red]error:[/] {escape(exc.what)}", highlight=False)
        for p in exc.problems:
            err_console.print(f"  - {p.render()}", highlight=False, markup=False)
        err_console.print(f"  [dim]{escape(exc.hint)}[/]", highlight=False)
        return
    err_console.print(f"[bold red]error:[/] {escape(exc.what)}", highlight=False)
    if exc.found:
        err_console.print(f"  found: {exc.found}", highlight=False, markup=False)
    if exc.hint:
        err_console.print(f"  [yellow]HINT:[/] {escape(exc.hint)}", highlight=False)


def os_error(exc: OSError) -> SwiftSlurmError:
    """An OSError no check caught (a path too long, a directory it may not search, a full disk) as one message."""
    from ..fsutil import describe_os_error

    where = exc.filename if exc.filename is not None else ""
    found = f"{where}: " if where else ""
    found += describe_os_error(where, exc).removeprefix("unreadable: ") if where else (exc.strerror or str(exc))
    return SwiftSlurmError("a file or directory could not be used", found,
                           "check the path (each name at most 255 bytes), its permissions and the free space; "
                           "--debug shows where it was met")


def guarded(fn=None, *, os_errors: bool = True):
    """Run a command body; typed errors become one message and the SPEC.md exit code. ``os_errors``: an
    OSError becomes one message too (exit 1); off for `run`, whose rank logs keep the traceback for doctor."""
    import functools

    if fn is None:
        return functools.partial(guarded, os_errors=os_errors)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            code = fn(*args, **kwargs)
        except SwiftSlurmError as exc:
            if _state["debug"]:
                raise
            print_error(exc)
            raise typer.Exit(exc.exit_code) from None
        except Unwritable as exc:  # a path the user named for us to write (-o FILE)
            if _state["debug"]:
                raise
            print_error(SwiftSlurmError("will not write there", f"{exc.path}: {exc.why}",
                                        "name a new path, or remove what is there yourself if it is yours to remove"))
            raise typer.Exit(2) from None  # as export's --to that is not new: bad input
        except BrokenPipeError:  # `swiftslurm logs JOB | head`: the reader left; silent, exit 1 as rich's own printing does
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(1) from None
        except OSError as exc:
            if _state["debug"] or not os_errors:
                raise
            print_error(os_error(exc))
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130) from None
        raise typer.Exit(code or 0)

    return wrapper


def load_plan(spec_path: Path, training: bool = False, data_notes: list[str] | None = None, limits=None):
    """The plan of a spec file after every check (``prepare.prepare``); the dataset scan's notes go to ``data_notes``."""
    from ..jobs.prepare import prepare

    prepared = prepare(spec_path, training=training, limits=limits)
    if data_notes is not None:
        data_notes += prepared.notes
    return prepared.plan


@app.command()
@guarded
def validate(specs: list[Path] = typer.Argument(..., help="One or more job spec TOML files.")) -> int:
    """Parse and check job specs (every check `plan` runs); print every problem. Exit 0 valid, 2 invalid."""
    from ..errors import SpecError
    from ..train.data.records import DataError

    worst = 0
    for spec_path in specs:
        notes: list[str] = []
        try:
            the_plan = load_plan(spec_path, data_notes=notes)
        except (SpecError, DataError) as exc:
            print_error(exc)
            worst = 2
            continue
        spec = the_plan.spec
        console.print(
            f"[green]ok[/] {escape(str(spec_path))}: job '{spec.job.name}', {spec.slurm.nodes} node(s) x "
            f"{spec.slurm.ranks_per_node} rank(s), {len(the_plan.tasks)} task(s)",
            highlight=False,
        )
        for note in notes:
            console.print(f"  {escape(note)}", highlight=False)
        for warning in the_plan.warnings:
            console.print(f"  [yellow]warning:[/] {escape(warning)}", highlight=False)
    return worst


@app.command()
@guarded
def plan(
    spec_path: Path = typer.Argument(..., metavar="SPEC", help="Job spec TOML."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON (for scripts)."),
    max_array_size: Optional[int] = MaxArraySize,
) -> int:
    """Show everything `submit` would do, sending nothing: tasks, allocation groups, DeepSpeed config per task, sbatch script(s), environment."""
    from ..jobs.prepare import prepare
    from ..jobs.send import avoid_bad_nodes
    from ..slurm.render import render_all

    limits = _limits(max_array_size)
    prepared = prepare(spec_path, limits=limits)
    the_plan, scripts = prepared.plan, prepared.scripts
    avoided: list[dict] = []
    if the_plan.spec.has_training:  # as submit to Slurm would: the ledger's recently failed nodes excluded
        the_plan, avoided = avoid_bad_nodes(the_plan)
        scripts = render_all(the_plan, limits=limits)
    # a dataset with images: their token bound and memory per task ("images" only then: a text job's plan is unchanged)
    images = {"images": {str(i): p.to_json() for i, p in prepared.images.items()}} if prepared.images else {}
    if as_json:
        sys.stdout.write(json.dumps({**the_plan.to_json(scripts, limits), "avoided": avoided, **images}, indent=2) + "\n")
        return 0
    from .plan_view import print_plan

    print_plan(console, the_plan, scripts, limits, avoided, prepared.images)
    return 0


@app.command()
@guarded
def render(
    spec_path: Path = typer.Argument(..., metavar="SPEC", help="Job spec TOML."),
    out: Optional[Path] = typer.Option(None, "-o", "--output", help="Write the script here instead of stdout."),
    max_array_size: Optional[int] = MaxArraySize,
) -> int:
    """Write a standalone sbatch script that plain `sbatch FILE` runs (no Python submitter).

    A sweep over allocation keys (slurm.nodes, slurm.time, ...) needs one script per allocation: with
    -o FILE they are written as FILE's name plus .group<N> (job.sh -> job.group0.sh, job.group1.sh);
    without -o such a spec is refused (one stdout cannot hold several scripts). With --max-array-size
    a sweep too big for one array is split too (job.part0.sh, job.part1.sh, ...).
    """
    from ..jobs.prepare import prepare
    from ..slurm.render import render_sbatch, script_names

    limits = _limits(max_array_size)
    prepared = prepare(spec_path, training=True, limits=limits)
    the_plan = prepared.plan
    parts = the_plan.arrays(limits)
    if out is None:
        if len(parts) > 1 and len(the_plan.groups) == 1:
            from ..errors import OneScriptTooFew

            raise OneScriptTooFew(
                f"the sweep needs {len(parts)} sbatch arrays under the site's cap, which one script cannot hold",
                f"{len(the_plan.tasks)} tasks, {limits.describe()}",
                "`swiftslurm render SPEC --max-array-size N -o FILE` writes one script per array (job.part0.sh, job.part1.sh, ...)",
            )
        # one script; a plan of several groups is refused, naming them
        sys.stdout.write(render_sbatch(the_plan, part=parts[0]) if len(parts) == 1 else render_sbatch(the_plan))
        return 0
    from ..plan import write_plan

    scripts = prepared.scripts
    paths = [out.with_name(n) for n in script_names(out.name, parts)]
    for path in paths:  # every one, before anything is written
        check_named_file(path)
        refuse_inside_sealed(path)
    write_plan(the_plan, scripts, limits)
    for path, script in zip(paths, scripts, strict=True):
        write_named_file(path, script)
    if len(paths) > 1:
        each = ", ".join(f"{p} (tasks {_ranges(part.tasks)})" for p, part in zip(paths, parts, strict=True))
        err_console.print(f"the sweep needs {len(paths)} sbatch arrays: wrote one script each: {each}; submit each with sbatch FILE; they read the "
                          f"plan written to {the_plan.plan_path}", highlight=False, markup=False)
    else:
        err_console.print(f"wrote {out} (run it with: sbatch {out}); it reads the plan written to {the_plan.plan_path}", highlight=False, markup=False)
    return 0


def _ranges(tasks) -> str:
    from ..slurm.render import index_ranges

    return index_ranges(tasks)


@app.command()
@guarded
def submit(
    spec_path: Path = typer.Argument(..., metavar="SPEC", help="Job spec TOML."),
    executor: ExecutorName = Executor,
    wait: bool = typer.Option(False, "--wait", "-w", help="Follow the job with a live table; exit 1 if any task failed."),
    as_json: bool = typer.Option(False, "--json", help="Print the submission record as JSON (job ids, dirs, the nodes avoided)."),
) -> int:
    """Submit the job (one job, or one sbatch array per allocation of a sweep); print job id(s) and where outputs go."""
    from .submit_cmd import submit_command

    if wait and as_json:
        raise SwiftSlurmError("--wait and --json do not go together", "both given", "use --json to print the submission, --wait to follow it")
    return submit_command(console, load_plan(spec_path, training=True), executor=executor.value, wait=wait, as_json=as_json)


@app.command()
@guarded
def status(
    target: str = typer.Argument(..., metavar="JOB_ID|OUTPUT_DIR"),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (for scripts)."),
    follow: bool = typer.Option(False, "--follow", "-f",
                                help="Follow the job until every task ended (live on a terminal, plain lines in a pipe); exit 1 if a task failed."),
    interval: Optional[float] = typer.Option(None, "--interval", min=0.0, help="Off a terminal: at most one line per task this often (seconds, default 10)."),
    sort: Optional[str] = typer.Option(None, "--sort", metavar="METRIC",
                                       help="Rank the tasks by a logged metric (eval_loss, loss, eval_rewards/accuracies, ...): each task's best "
                                            "value, lowest first for a loss or a time, highest first otherwise; tasks without it last."),
) -> int:
    """State of every array task with its progress (step, loss, tokens/s, ETA, elapsed), restarts and the latest
    verified checkpoint; a sweep's tasks with their overrides, best final loss first (or by --sort METRIC)."""
    from .submit_cmd import status_command

    if follow and (as_json or sort):
        from ..errors import SwiftSlurmError

        raise SwiftSlurmError(f"--follow and {'--json' if as_json else '--sort'} do not go together", "both given",
                              "use --json or --sort for one look, --follow to watch")
    return status_command(console, target, as_json=as_json, follow_=follow, interval_s=interval, sort=sort)


@app.command()
@guarded
def logs(
    target: str = typer.Argument(..., metavar="OUTPUT_DIR", help="The job.output_dir of a submitted spec, or one task dir of a sweep."),
    rank: Optional[int] = typer.Option(None, "--rank", "-r", min=0, help="Only this rank's log."),
    node: Optional[str] = typer.Option(None, "--node", "-n", help="Only the ranks that ran on this node."),
    task: Optional[int] = typer.Option(None, "--task", "-t", min=0, help="Only this array task (default: all of them)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines until the job ends."),
    tail: Optional[int] = typer.Option(None, "--tail", min=0, help="Only the last N lines."),
    errors: bool = typer.Option(False, "--errors", "-E", help="Only tracebacks and error lines, each once, with the rank that printed it first."),
    attempt: Optional[int] = typer.Option(None, "--attempt", "-a", min=1, help="Only the N-th attempt (1 = the first start; each walltime "
                                          "requeue, chain link and in-job restart begins another; every rank logs a header per attempt)."),
) -> int:
    """The ranks' logs, interleaved by time with a "rank r node" prefix (Slurm and local jobs)."""
    from .watch_cmd import logs_command

    if rank is not None and node is not None:
        from ..errors import SwiftSlurmError

        raise SwiftSlurmError("--rank and --node do not go together", f"--rank {rank} --node {node}", "pick one rank, or every rank of one node")
    return logs_command(console, target, rank, node, task, follow, tail, errors, attempt=attempt)


@app.command()
@guarded
def plot(
    target: str = typer.Argument(..., metavar="OUTPUT_DIR", help="The job.output_dir of a submitted spec, or one task dir."),
    out: Optional[Path] = typer.Option(None, "-o", "--output", help="PNG file to write (default: metrics.png next to the metrics)."),
) -> int:
    """Loss and (useful) tokens/s against step, one line per task of a sweep, requeue points marked."""
    from .watch_cmd import plot_command

    return plot_command(console, target, out)


@app.command()
@guarded
def doctor(
    target: str = typer.Argument(..., metavar="OUTPUT_DIR|TASK_DIR|JOB_ID"),
    as_json: bool = typer.Option(False, "--json", help="Print the findings as a JSON list, each with a stable `code`."),
) -> int:
    """Read what a job left (rank logs, metrics, preflight report, requeues, Slurm state) and say what went wrong:
    each finding with its evidence (file, line, rank, node, step), cause and fix. Exit 0 nothing found, 6 findings."""
    from .doctor_cmd import doctor_command

    return doctor_command(console, target, as_json)


@app.command()
@guarded
def nodes(
    as_json: bool = typer.Option(False, "--json", help="Print the ledger as JSON."),
    clear: list[str] = typer.Option([], "--clear", metavar="NODE", help="Forget this node (repeatable)."),
    clear_all: bool = typer.Option(False, "--clear-all", help="Forget every node."),
) -> int:
    """The node-health ledger: nodes that failed a preflight, hung or lost a rank (submit excludes them for
    slurm.bad_node_ttl_h hours). Path: $SWIFTSLURM_LEDGER, default ~/.swiftslurm/ledger.json."""
    from .nodes_cmd import nodes_command

    return nodes_command(console, as_json, clear, clear_all)


@app.command()
@guarded
def cancel(target: str = typer.Argument(..., metavar="JOB_ID|OUTPUT_DIR")) -> int:
    """Cancel a job (all its array tasks)."""
    from .submit_cmd import cancel_command

    return cancel_command(console, target)


@app.command()
@guarded
def preflight(
    spec_path: Path = typer.Argument(..., metavar="SPEC", help="Job spec TOML."),
    executor: ExecutorName = Executor,
    json_file: Optional[Path] = typer.Option(None, "--json", help="Also write the report as JSON here."),
) -> int:
    """A preflight-only diagnostic job on the nodes the spec asks for (no training). Exit 4 if a check failed."""
    from .preflight_cmd import preflight_command

    if json_file is not None:
        check_named_file(json_file)  # refused now, not after the job ran
        refuse_inside_sealed(json_file)
    return preflight_command(console, load_plan(spec_path), executor=executor.value, json_file=json_file)


@app.command()
@guarded
def verify(path: Path = typer.Argument(..., help="A checkpoint directory, or an output dir holding several.")) -> int:
    """Verify checkpoints against their manifests; name what is damaged. Exit 5 if the newest is damaged."""
    from .verify_cmd import verify_command

    return verify_command(console, path)


@app.command(name="import")
@guarded
def import_(
    path: Path = typer.Argument(..., help="An HF Trainer checkpoint-N (with or without DeepSpeed), a model dir or a peft adapter dir."),
    into: Path = typer.Option(..., "--into", help="Output dir to place it in, as checkpoint-<step>."),
    as_json: bool = typer.Option(False, "--json", help="Print what it holds as JSON."),
) -> int:
    """Check a checkpoint we did not write (indexes, file sizes, shards of every rank), commit it under DIR with our
    manifest, and say what it holds (step, world size, ZeRO stage, dtype). Exit 5 if damaged, 2 if not a checkpoint
    (or it points outside itself), 3 if a live job owns DIR."""
    from .import_cmd import import_command

    return import_command(console, path, into, as_json)


class ExportDtype(str, Enum):
    auto = "auto"
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


class ExportWhere(str, Enum):
    local = "local"
    slurm = "slurm"


@app.command()
@guarded
def export(
    source: str = typer.Argument(..., metavar="SOURCE", help="A checkpoint-N dir, a run's output dir (its best, else newest verified checkpoint) or a job id."),
    to: Path = typer.Option(..., "--to", help="New or empty dir for the model (never overwritten)."),
    task: Optional[int] = typer.Option(None, "--task", "-t", min=0, help="The task of a sweep's output dir."),
    merge_lora: bool = typer.Option(True, "--merge-lora/--adapter-only", help="A LoRA run: merge the adapter into its base (default), or keep it alone."),
    dtype: ExportDtype = typer.Option(ExportDtype.auto, "--dtype", help="Weights dtype; auto = what the run trained in."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest safetensors shard (an index names them)."),
    base_model: Optional[str] = typer.Option(None, "--base-model", help="The model a LoRA adapter was trained on (default: the run's train.model)."),
    executor: ExportWhere = typer.Option(ExportWhere.local, "--executor", "-e", help="local: in this process, on the CPU; slurm: a one-node Slurm job."),
    wait: bool = typer.Option(False, "--wait", "-w", help="With --executor slurm: wait for the job to end."),
    partition: Optional[str] = typer.Option(None, "--partition", help="With --executor slurm: the partition."),
    account: Optional[str] = typer.Option(None, "--account", help="With --executor slurm: the account."),
    time_limit: str = typer.Option("02:00:00", "--time", help="With --executor slurm: the job's time limit."),
    cpus: int = typer.Option(8, "--cpus", min=1, help="With --executor slurm: CPUs of the job."),
    mem: Optional[str] = typer.Option(None, "--mem", help="With --executor slurm: memory of the job (sbatch --mem)."),
    as_json: bool = typer.Option(False, "--json", help="Print what was written (or the job submitted) as JSON."),
) -> int:
    """Write a Hugging Face model dir (safetensors shards + index, config, tokenizer, chat template) that transformers
    and vLLM load: ZeRO shards gathered, a LoRA adapter merged, our manifest inside (`swiftslurm verify DIR`).
    Exit 5 if the checkpoint is damaged or not ours, 2 if --to is not new or empty."""
    from ..export.job import ExportRequest
    from .export_cmd import export_command

    source_text = source if path_kind(source) == MISSING else str(Path(source).absolute())  # else a job id
    req = ExportRequest(source_text, to.absolute(), task, not merge_lora, dtype.value, max_shard_size, base_model, partition, account,
                        time_limit, cpus, mem)
    return export_command(console, err_console, req, executor.value, wait, as_json)


@app.command()
@guarded(os_errors=False)
def run(
    plan_file: Optional[Path] = typer.Option(None, "--plan", help="Plan JSON (default: $SWIFTSLURM_PLAN)."),
    task: Optional[int] = typer.Option(None, "--task", help="Array task index (default: $SLURM_ARRAY_TASK_ID or 0)."),
) -> int:
    """The on-node entry point that srun starts on every rank (users rarely call it)."""
    from ..node.runtime import run_from_cli

    return run_from_cli(plan_file, task)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
