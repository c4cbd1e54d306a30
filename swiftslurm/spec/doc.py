"""The spec reference in the README, generated from the model so docs and code cannot drift.

`python -m swiftslurm.spec.doc` prints the Markdown; a test checks the README holds exactly it.
"""

from __future__ import annotations

from typing import Any

from .load import CHECKS, JobSpec, table_model

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
    "train.model": "a hub id, a local directory, or `tiny-llama` (a 2-layer test model built from a config, no download)",
    "train.dataset": "one path or a list, read in order and mixed: JSONL (`.jsonl`), JSON arrays (`.json`), `.parquet`, `.arrow`, or a `datasets` "
                     "`save_to_disk` directory; records in alpaca (`instruction`/`input`/`output`) or messages (`[{role, content}]`) format",
    "train.train_type": "`lora` or `full`",
    "train.deepspeed": "a preset (`zero0` ... `zero2_fast`), a path to a DeepSpeed JSON, or `\"none\"`: plain DDP, no DeepSpeed (the path for GaLore/APOLLO)",
    "train.bf16": "bf16 mixed precision",
    "train.fp16": "fp16 mixed precision (not with bf16)",
    "train.gradient_checkpointing": "recompute activations in the backward pass: `true`, `false`, or `\"auto\"` = off where `plan`'s memory "
                                    "estimate without it (+15%) fits `slurm.gpu_memory_gb`, else on; on for CPU jobs and unknown model shapes",
    "train.per_device_train_batch_size": "micro-batch per rank",
    "train.gradient_accumulation_steps": "micro-batches per optimizer step",
    "train.learning_rate": "peak learning rate",
    "train.max_grad_norm": "clip the global gradient norm to this (0 = no clipping, and then no `grad_norm` in the logs); `doctor`'s "
                           "`nan_grad_norm` suggests 0.5",
    "train.ddp_timeout": "seconds a collective may wait for the other ranks before the process group aborts (TrainingArguments' `ddp_timeout`, and "
                         "`DEEPSPEED_TIMEOUT` rounded up to minutes); unset = 30 minutes",
    "train.straggler_window": "every this many steps the ranks share their time outside collectives; a rank over `straggler_factor` x "
                              "the others' median for 3 windows in a row is named (log, metrics, `doctor`, the ledger as slow); 0 = off",
    "train.straggler_factor": "how much slower than the other ranks' median a rank's window must be to count as slow (docs/runtime.md, "
                              "Stragglers)",
    "train.weight_decay": "AdamW weight decay",
    "train.warmup_ratio": "fraction of the steps spent warming up",
    "train.lr_scheduler_type": "`linear`, `cosine`, `constant`, `constant_with_warmup`",
    "train.max_steps": "optimizer steps (or `num_train_epochs`, not both)",
    "train.num_train_epochs": "epochs when `max_steps` is unset (default 1)",
    "train.max_length": "tokens per sample; longer samples are truncated",
    "train.save_steps": "a verified checkpoint every this many steps",
    "train.logging_steps": "metrics every this many steps",
    "train.seed": "seed for init, data order and dropout",
    "train.lora_rank": "LoRA rank",
    "train.lora_alpha": "LoRA alpha",
    "train.lora_dropout": "LoRA dropout",
    "train.lora_target_modules": "`all-linear` or a list of module names",
    "train.report_to": "`tensorboard`, `wandb`, `mlflow` (the `tracking` extra; one run per training across requeues: "
                       "docs/training.md) and/or `none`",
    "train.packing": "pack whole samples into rows of exactly `max_length` tokens (`per_device_train_batch_size` then counts packed rows); "
                     "attention and labels never cross a sample",
    "train.attn_implementation": "`auto` (the fastest correct kernel on the node: `flash_attention_2` where installed, else on GPUs `varlen_attn` "
                                 "for packed bf16/fp16 rows where the flash kernel runs (sm80+), `flex_attention` for other packed rows of 4096 "
                                 "tokens or more, `sdpa` otherwise; `sdpa` on the CPU), `sdpa`, `eager`, `flex_attention`, `varlen_attn` (PyTorch's "
                                 "own flash kernel for packed samples, no flash-attn build: GPU sm80+, packing, bf16/fp16), `flash_attention_2`, "
                                 "`flash_attention_3`",
    "train.compile": "regional `torch.compile`: each decoder layer compiled in place (one graph serves every layer; checkpoints unchanged; "
                     "Liger's kernels off with it). Off by default: on an H200 it gave an 8B LoRA +3% (within run-to-run noise) for "
                     "~105 s more start-up on every start and requeue, and a 0.5B full fine-tune 0.87x (docs/benchmarks.md)",
    "train.fused_lora": "LoRA (every task): each adapted projection runs its frozen base and the adapter in one autograd function, the same "
                        "function as peft's with fewer full-width passes and no per-projection copy of the dropped-out input "
                        "(train/kernels/lora.py); on GPUs the LoRA dropout mask is drawn inside the adapter's matmuls (Triton), "
                        "nothing stored: the same law as peft's masks, not the same draws; not under ZeRO-3 or `compile`; "
                        "`false` = peft's own forward",
    "train.use_liger_kernel": "Liger's fused kernels: `true` = all of them, the linear cross-entropy too (a GPU, `liger-kernel`, not ZeRO-3; on an "
                              "H200 it halved memory but cost 12-23% of packed tokens/s; `plan` names it when it would make a run fit), `false`, or "
                              "`auto` = its RMSNorm, RoPE and SwiGLU where `liger-kernel` is installed on a GPU (not ZeRO-3, not DPO), never the fused loss",
    "train.dataset_scan": "validate, plan and submit read every record of the dataset and name a malformed one (file and line, or row index); false "
                          "skips that scan (huge data: the trainer still checks every record when it tokenizes)",
    "train.dataset_num_proc": "processes that tokenize the dataset (once: the result is cached next to the checkpoints)",
    "train.dataloader_num_workers": "DataLoader worker processes per rank (0 = in the training process)",
    "train.dataloader_pin_memory": "pinned host memory for batches (GPU runs)",
    "train.resume_from": "start this run (its own `output_dir`) from another checkpoint: a `checkpoint-N` of ours (verified first; a damaged one "
                         "stops the run, exit 5), another run's output dir (its newest verified), or one we did not write (an HF Trainer + "
                         "DeepSpeed `checkpoint-N`, a model dir, a peft adapter dir: imported on the fly). Restores weights, optimizer, scheduler, "
                         "RNG and data position; a requeue of this run resumes from its own newest checkpoint; never this run's own output dir "
                         "(or a task's, or inside them). See docs/checkpoints.md",
    "train.resume_weights_only": "with `resume_from`: only the weights; a fresh optimizer, schedule and data order from step 0 (always so for a "
                                 "model or adapter dir)",
    "train.task": "`sft` (supervised), `dpo` (preference pairs `prompt`/`chosen`/`rejected`, through TRL's DPOTrainer), `pt` "
                  "(continued pretraining on raw `text` records: every token a label, packed; docs/training.md), `rm` (a reward "
                  "model with a 1-output score head, on the same pairs, through TRL's RewardTrainer), `kto` (unpaired "
                  "`prompt`/`completion`/`label` records, through TRL's KTOTrainer) or `grpo` (online RL: prompts scored by "
                  "`reward_funcs`, through TRL's GRPOTrainer; docs/training.md)",
    "train.dpo_beta": "DPO and KTO: how far the policy may move from the reference model (TRL's `beta`)",
    "train.dpo_loss_type": "DPO: one of TRL's loss types (`sigmoid`, `ipo`, `hinge`, `robust`, `apo_zero`, ...)",
    "train.precompute_ref_log_probs": "DPO and KTO: score the reference once before training and keep no reference model",
    "train.kto_desirable_weight": "KTO: weight of the loss of desirable completions (`label = true`); raise the rarer label's weight "
                                  "when the counts differ (TRL's `desirable_weight`)",
    "train.kto_undesirable_weight": "KTO: weight of the loss of undesirable completions (`label = false`; TRL's `undesirable_weight`)",
    "train.max_prompt_length": "DPO: keep at most this many prompt tokens (the end of the prompt); below `max_length`",
    "train.reward_funcs": "GRPO: what scores each completion, in order: built-ins `length`, `format`, `accuracy` (against the `solution` column), "
                          "`file.py:function` (a file next to the spec, or a path relative to it) or `module:function` (importable on the nodes); "
                          "called as `f(prompts, completions, completion_ids, **columns)` -> one float per completion. One that raises stops "
                          "every rank with exit code 70, naming it and the sample",
    "train.reward_weights": "GRPO: one weight per `reward_funcs` entry (unset: all 1.0); the reward is their weighted sum",
    "train.reward_length_target": "GRPO, built-in `length`: the completion length in tokens that scores 1.0 (0 at none or twice as many)",
    "train.reward_format_regex": "GRPO, built-in `format`: 1.0 when the completion matches this Python regular expression in full (`re.DOTALL`)",
    "train.num_generations": "GRPO: completions per prompt, compared with each other; must divide micro-batch x world size x accumulation steps",
    "train.max_completion_length": "GRPO: tokens generated per completion at most; below `max_length`",
    "train.temperature": "GRPO: sampling temperature of the generation",
    "train.grpo_beta": "GRPO: weight of the KL to the starting model (TRL's `beta`); 0 = no reference model, LoRA scores it with the adapter off",
    "train.use_vllm": "GRPO: generate with vLLM in TRL's colocate mode (GPUs, vLLM installed on the nodes; refused otherwise); false = HF "
                      "`generate` with the model on each rank",
    "train.optimizer": "`adamw`, or `galore_adamw` / `galore_adamw_8bit` / `apollo_adamw` (full FT with `deepspeed = \"none\"`)",
    "train.galore_rank": "GaLore/APOLLO: rank of the gradient projection",
    "train.galore_update_proj_gap": "GaLore/APOLLO: steps between projection updates",
    "train.galore_scale": "GaLore/APOLLO: scale of the projected update (unset: the library default)",
    "train.model_shape": "a hub model not on disk: "
                         "`{ hidden_size, num_layers, heads, kv_heads, intermediate_size, vocab_size, tie_word_embeddings, head_dim, model_type }` "
                         "for `plan`'s memory estimate and the head checks at `validate` (a local model's config.json and `tiny-llama` need none); "
                         "`model_type` (config.json's, e.g. `\"qwen2\"`) lets the estimate count Liger's layers where Liger patches that type",
    "train.eval_dataset": "files to evaluate on (formats as `dataset`): tokenized, cached and packed like the training data; not with `eval_split`",
    "train.eval_split": "hold out this fraction of `dataset`'s records for evaluation (at least one), drawn with a fixed seed (the same records "
                        "for every run and sweep task, whatever `seed` is); `0` = no split",
    "train.eval_steps": "evaluate every this many steps, on all ranks, one `eval_loss` (unset: `save_steps`); an evaluation that beats the best "
                        "so far also saves a checkpoint",
    "train.per_device_eval_batch_size": "eval micro-batch per rank (packed rows with `packing`); unset: `per_device_train_batch_size`",
    "train.metric_for_best_model": "the logged eval metric that picks the best checkpoint (`latest_best`, kept by retention) and drives early "
                                   "stopping: `eval_loss`, or for DPO `eval_rewards/accuracies`, `eval_rewards/margins`, ...",
    "train.greater_is_better": "whether a higher `metric_for_best_model` is better; unset: lower for names ending in `loss` (or a time), "
                               "higher otherwise",
    "train.early_stopping_patience": "stop (COMPLETED, the reason in the summary and `status`) after this many evaluations in a row without "
                                     "a new best; the count survives a requeue; unset = never",
    "train.command": "run your own script instead of the built-in trainer, e.g. `[\"python\", \"train.py\"]`, with the same env, preflight and requeue",
    "checkpoint.keep": "verified checkpoints kept (at least 2)",
    "checkpoint.forced_save_fractions": "extra saves at these fractions of `max_steps`",
    "checkpoint.checksum": "`xxh3`, `md5` or `sha256`",
    "checkpoint.convert_timeout_s": "resuming on another data-parallel world size or ZeRO stage converts the checkpoint with DeepSpeed's "
                                    "universal-checkpoint tool on rank 0; longer than this is an error on every rank (docs/checkpoints.md)",
    "checkpoint.deadline_save": "save before the USR2 signal when the job's end time (read from Slurm at each start) leaves no room for the next "
                                "regular save; `deadline_margin_s` in metrics.jsonl",
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
                desc = DESCRIPTIONS[f"{table}.{key}"]
                lines.append(f"| `{table}.{key}` | `{shown}` | {desc} |")
        else:
            lines.append(f"| `[{table}]` | empty | {TABLE_NOTES[table]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference_markdown())
