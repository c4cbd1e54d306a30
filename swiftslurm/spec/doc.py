"""The spec reference in the README, generated from the model so docs and code cannot drift.

`python -m swiftslurm.spec.doc` prints the Markdown; a test checks the README holds exactly it. A ``[train]`` key's
meaning is its field's description (``spec/train_fields.py``, by concern); the other tables' are here until they move
onto their fields the same way.
"""

from __future__ import annotations

from typing import Any

from .load import table_model
from .model import CHECKS, JobSpec

DESCRIPTIONS: dict[str, str] = {
    "job.name": "Slurm job name; letters, digits, `.`, `_`, `-`",
    "job.output_dir": "where logs, TensorBoard events and checkpoints go; with a sweep, `output_dir/<task-index>` per task",
    "slurm.partition": "sbatch `--partition`",
    "slurm.account": "sbatch `--account`",
    "slurm.qos": "sbatch `--qos`",
    "slurm.constraint": "sbatch `--constraint`",
    "slurm.exclude": "sbatch `--exclude` (a hostlist)",
    "slurm.nodelist": "sbatch `--nodelist` (a hostlist)",
    "slurm.reservation": "sbatch `--reservation`",
    "slurm.nodes": "number of nodes",
    "slurm.gpus_per_node": "GPUs per node; one rank per GPU",
    "slurm.tasks_per_node": "ranks per node; defaults to `gpus_per_node` (or 1); set it for CPU runs; must equal `gpus_per_node` on GPU runs",
    "slurm.cpus_per_task": "CPUs per rank",
    "slurm.mem": "sbatch `--mem` syntax (`0` = all of the node's memory); unset = the cluster default",
    "slurm.time": "sbatch `--time` syntax (`30`, `01:00:00`, `1-12:00:00`)",
    "slurm.signal_grace_s": "USR2 arrives this long before the walltime: one step + one save must fit (USR1 is NCCL's)",
    "slurm.max_requeues": "walltime requeues per submitted job before it gives up; a stop not requeued fails the job (exit 75) and `status` says why",
    "slurm.no_progress_attempts": "the progress guard: after this many walltime attempts in a row that committed no checkpoint newer "
                                  "than the one they started from, the job stops for good (exit 79, the reason in `requeues.json` and "
                                  "`status`) instead of requeueing again; 0 = never (only `max_requeues` bounds it)",
    "slurm.continue_with": "after a walltime stop: `requeue` (`scontrol requeue`, the same job id) or `singleton`, for sites that refuse "
                           "requeue: the same batch script is submitted again with `--dependency=singleton` and `status` follows the chain "
                           "(`max_requeues` counts its links; docs/runtime.md)",
    "slurm.max_restarts": "in-job restarts per job: a failed or hung training step (a killed rank, a lost node, the watchdog's stall) starts again "
                          "inside the same allocation (`--no-kill`) from the newest verified checkpoint, each recorded in `restarts.json`; "
                          "0 = a failure ends the job, as before (docs/runtime.md, Failure model)",
    "slurm.spare_nodes": "nodes allocated beyond `nodes` (needs `max_restarts`): a node that failed is dropped, recorded in the node-health "
                         "ledger, and a spare takes its place at the restart; with none left the run stops with the reason",
    "slurm.shrink_on_failure": "with no spare left, restart on the nodes that remain (needs `max_restarts`; data parallel only): the run "
                                "resumes on fewer ranks from the newest verified checkpoint (converted to the smaller world) instead of stopping",
    "slurm.array_parallelism": "with a sweep: at most this many array tasks at once (`--array=0-N%P`)",
    "slurm.gpu_memory_gb": "memory of one GPU; `plan` warns when its per-rank estimate exceeds it and names a ZeRO setting that fits",
    "slurm.extra_sbatch": "raw sbatch options, each `--key=value` or `--flag`; resolved as sbatch resolves abbreviations, options swiftslurm sets "
                          "refused in every spelling (docs/submitting.md)",
    "slurm.setup": "shell lines run in the batch script before the ranks start (`module load cuda/12.4`, `source /shared/venv/bin/activate`): "
                   "written verbatim, so they ARE shell; each entry one line, no NUL. `validate` checks them with `bash -n` and refuses what keeps "
                   "the script from its srun line (an unterminated here-document, `exit`, `exec CMD`, `set -n`, a function named `srun`)",
    "slurm.avoid_bad_nodes": "`submit` adds nodes of the node-health ledger (failed a preflight, hung, lost a rank) to `--exclude` and says so; "
                             "never into a job the partition can no longer satisfy (docs/doctor.md)",
    "slurm.bad_node_ttl_h": "a ledger entry older than this many hours no longer excludes its node",
    "slurm.python": "the interpreter the ranks run (swiftslurm and submitit installed in it), one word (a path or a command on PATH, never starting "
                    "with `-`); unset = the submitting one, or `python3` inside a container",
    "checkpoint.keep": "verified checkpoints kept (at least 2)",
    "checkpoint.forced_save_fractions": "extra saves at these fractions of `max_steps`",
    "checkpoint.checksum": "`xxh3`, `md5` or `sha256`",
    "checkpoint.convert_timeout_s": "resuming on another data-parallel world size or ZeRO stage converts the checkpoint with DeepSpeed's "
                                    "universal-checkpoint tool on rank 0; longer than this is an error on every rank (docs/checkpoints.md)",
    "checkpoint.deadline_save": "save before the USR2 signal when the job's end time (read from Slurm at each start) leaves no room for the next "
                                "regular save; `deadline_margin_s` in metrics.jsonl",
    "checkpoint.async_save": "save in the background: training stops only while the step's state is copied to host memory (pinned), "
                             "then a writer thread writes, hashes and commits it; the same bytes and manifest as a synchronous save, "
                             "and nothing is published before it verifies. A walltime, deadline or last save waits for its commit. "
                             "`\"auto\"`: on for GPU jobs whose copy fits `slurm.mem`, off for CPU jobs (docs/checkpoints.md)",
    "checkpoint.allow_spec_change": "resume a checkpoint although the training spec changed since it was saved (`train.*` but logging/saving, "
                                    "`[deepspeed]`, the resolved DeepSpeed essentials, the dataset files); off: such a resume is refused, naming "
                                    "the changed keys. The allocation never counts",
    "preflight.checks": "any of " + ", ".join(f"`{name}`" for name in CHECKS) + "; `[]` disables",
    "preflight.min_allreduce_busbw_gbps": "all-reduce bus bandwidth floor, GB/s (0 = report only)",
    "preflight.min_iperf3_gbps": "iperf3 floor between node pairs, Gbit/s; unset: 20, and a miss only warns (a value you set fails the check)",
    "preflight.min_nvme_iops": "fio 4k random-read IOPS floor per node; unset: 50000, and a miss only warns",
    "preflight.iperf3_streams": "parallel iperf3 streams per pair (`-P`)",
    "preflight.iperf3_duration_s": "seconds each iperf3 pair measures (`-t`)",
    "preflight.min_disk_free_gb": "free space needed in `output_dir`, GB",
    "preflight.nvme_path": "where `fio` tests; unset: the DeepSpeed config's NVMe offload `nvme_path`, else the checkpoint dir (the task's output dir)",
    "preflight.on_failure": "`abort` (no training), `warn`, or `exclude` (requeue without the failing nodes)",
    "preflight.timeout_s": "bound on each check (a hung rank is reported, never waited for)",
    "parallel.sequence_parallel": "Ulysses sequence parallel degree (DeepSpeed ALST): each sequence is split over this many ranks; heads must "
                                  "divide by it, `max_length` must be a multiple of it; a ZeRO preset (not `deepspeed = \"none\"`); with packed "
                                  "rows, a kernel that keeps samples apart: `varlen_attn` (torch's flash kernel, sm80+ GPUs, bf16/fp16; what `auto` "
                                  "takes there) or flash-attn (a CPU job is refused at `validate`)",
    "parallel.tensor_parallel": "DeepSpeed AutoTP degree: each Linear layer is split over this many ranks (full fine-tuning, ZeRO 0-2, not "
                                "`deepspeed = \"none\"`); world size = data x sequence x tensor parallel",
    "parallel.tiled_mlp": "DeepSpeed's TiledMLP for long sequences: each gated MLP computes over ceil(seq / hidden) slices of the sequence and "
                          "recomputes them in the backward (less activation memory, one more MLP forward); a ZeRO preset, not `deepspeed = \"none\"`",
    "container.runtime": "`pyxis` (`srun --container-image`, pyxis/enroot) or `apptainer` (`apptainer exec`)",
    "container.image": "a registry image (`nvcr.io#nvidia/pytorch:24.05-py3`, `docker://...`; pin with `@sha256:`) or a local `.sif`/`.sqsh` file "
                       "(checked by `validate`)",
    "container.mounts": "`SRC:DST[:FLAGS]` host paths into the container (Apptainer flags: `ro`/`rw`); the output dir is mounted automatically (so "
                        "no `:` or `,` in it), and a read-only mount over it is refused",
    "container.workdir": "working directory inside the container (pyxis `--container-workdir`, Apptainer `--pwd`)",
    "container.writable": "a writable container filesystem (pyxis `--container-writable`, Apptainer `--writable-tmpfs`)",
    "container.env": "host variables whose values override the image's (pyxis `--container-env`, Apptainer `APPTAINERENV_*`)",
}

TABLE_NOTES = {
    "deepspeed": "overrides deep-merged into the chosen preset, e.g. `zero_optimization = { offload_optimizer = { device = \"cpu\" } }`",
    "env": "environment variables exported on every node (`NCCL_*` and friends); your values win, except the ones swiftslurm derives per rank "
           "(`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `NODE_RANK`, `GROUP_RANK`, `NNODES`, `SWIFTSLURM_PLAN`, `SWIFTSLURM_TASK`: "
           "refused); `MASTER_ADDR`/`MASTER_PORT` may be set",
    "sweep": "a job array over the cartesian product: `learning_rate = [1e-4, 2e-4]` (a `[train]` key) or `\"slurm.nodes\" = [1, 2]`",
}


def _fmt_default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_fmt_default(v) for v in value) + "]"
    return repr(value)


def reference_markdown() -> str:
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for table, field in JobSpec.model_fields.items():
        model = table_model(field.annotation)
        if model is not None:
            for key, sub in model.model_fields.items():
                try:
                    default = sub.get_default(call_default_factory=True)
                except Exception:
                    default = None
                shown = "required" if sub.is_required() else _fmt_default(default)
                desc = sub.description or DESCRIPTIONS[f"{table}.{key}"]  # [train]: on the field (train_fields.py)
                lines.append(f"| `{table}.{key}` | `{shown}` | {desc} |")
        else:
            lines.append(f"| `[{table}]` | empty | {TABLE_NOTES[table]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference_markdown())
