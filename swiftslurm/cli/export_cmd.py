"""`swiftslurm export SOURCE --to DIR`: a verified checkpoint as a Hugging Face model dir (here, or as a Slurm job)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from ..errors import JobFailedError
from ..export.job import ExportRequest, submit_export, wait_job
from ..export.run import export_here
from ..export.write import Exported

WEIGHTS_TEXT = {"merged-lora": "LoRA adapter merged into {base}", "full": "full", "adapter": "LoRA adapter only (base {base})"}


def export_command(console: Console, err_console: Console, req: ExportRequest, executor: str, wait: bool, as_json: bool) -> int:
    if executor == "slurm":
        return _as_job(console, req, wait, as_json)

    def log(line: str) -> None:
        err_console.print(line, highlight=False, markup=False)

    # the libraries print their own progress to stdout: in a script's --json run, stdout carries the JSON alone
    quiet = contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext()
    with quiet:
        done = export_here(req.source, req.to, task=req.task, adapter_only=req.adapter_only, dtype=req.dtype,
                           max_shard_size=req.max_shard_size, base_model=req.base_model, log=log)
    if as_json:
        print(json.dumps(done.as_dict(), indent=1))
        return 0
    _report(console, done)
    return 0


def _report(console: Console, done: Exported) -> None:
    console.print(f"exported [bold]{escape(done.source_checkpoint)}[/] as [bold]{escape(done.path)}[/] (verified)", highlight=False)
    rows = [("weights", WEIGHTS_TEXT[done.weights].format(base=done.base_model or "?")), ("dtype", done.dtype), ("step", str(done.step)),
            ("files", f"{len(done.files)} ({done.bytes / 1e6:.1f} MB)")]
    for label, value in rows:
        console.print(f"  {label:<8} {escape(value)}", highlight=False)
    for line in done.skipped:
        console.print(f"  skipped  {escape(line)} (damaged)", highlight=False)
    quoted = escape(json.dumps(done.path))
    if done.weights == "adapter":
        console.print(f"  load it  PeftModel.from_pretrained(base_model, {quoted})", highlight=False)
    elif done.model_class == "AutoModelForCausalLM":
        console.print(f"  load it  AutoModelForCausalLM.from_pretrained({quoted}), or: vllm serve {escape(done.path)}", highlight=False)
    else:  # a reward model: one score per sequence, from the logits of its last token
        console.print(f"  load it  {done.model_class}.from_pretrained({quoted})", highlight=False)
    console.print(f"  check it swiftslurm verify {escape(done.path)}", highlight=False)


def _as_job(console: Console, req: ExportRequest, wait: bool, as_json: bool) -> int:
    from ..export.write import check_target

    check_target(req.to, Path(req.source))  # refused here, not minutes later in the job
    job_id = submit_export(req)
    log = str(req.log_pattern()).replace("%j", job_id)
    if as_json and not wait:
        print(json.dumps({"job_id": job_id, "to": str(req.to), "log": log, "script": str(req.script_path())}, indent=1))
        return 0
    console.print(f"submitted export job [bold]{job_id}[/]: the model will be at {escape(str(req.to))}", highlight=False)
    console.print(f"  log: {escape(log)}", highlight=False)
    if not wait:
        console.print(f"  follow it: swiftslurm status {job_id}; check the result: swiftslurm verify {escape(str(req.to))}", highlight=False)
        return 0
    state = wait_job(job_id)
    if state != "COMPLETED":
        raise JobFailedError(f"export job {job_id} ended {state}", f"log: {log}", "the log's last lines say why; fix it and export again")
    if as_json:
        print(json.dumps({"job_id": job_id, "to": str(req.to), "log": log, "state": state}, indent=1))
    else:
        console.print(f"export job {job_id} COMPLETED: {escape(str(req.to))} (check it: swiftslurm verify {escape(str(req.to))})", highlight=False)
    return 0
