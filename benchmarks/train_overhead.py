"""swiftslurm's trainer vs a bare HF Trainer + DeepSpeed script: same model, data, config, same processes.

    .venv/bin/python benchmarks/train_overhead.py [--nprocs 2] [--steps 200] [--repeats 3] [--deepspeed zero2]

Each of the N ranks runs, alternately and ``--repeats`` times: (a) a plain ``transformers.Trainer`` with
the same TrainingArguments and DeepSpeed dict, saving once at the last step like (b); (b)
``swiftslurm.train.run.train`` (verified checkpoint commit, measured metrics, stop all-reduce,
metrics.jsonl). Both use the tiny model, the shipped alpaca data and the same seed, so they process the
same tokens. Throughput = non-padding tokens (counted in the bare run's collator, all ranks) / ``train_runtime`` (the HF
Trainer's own wall time of the training loop, identical code for both). The best of the repeats counts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_spec(args, out: str):
    from swiftslurm.spec import validate_spec

    return validate_spec({
        "job": {"name": "bench", "output_dir": out},
        "slurm": {"nodes": 1, "tasks_per_node": args.nprocs},
        "train": {"model": "tiny-llama", "dataset": [str(ROOT / "examples/data/alpaca_demo.jsonl"),
                                                     str(ROOT / "examples/data/messages_demo.jsonl")],
                  "train_type": "full", "deepspeed": args.deepspeed, "gradient_checkpointing": False,
                  "per_device_train_batch_size": 8, "learning_rate": 1e-3, "lr_scheduler_type": "constant",
                  "max_steps": args.steps, "save_steps": args.steps, "logging_steps": 10, "max_length": 128,
                  "packing": False},  # the bare arm pads per batch: compare the trainers, not the batching
        "checkpoint": {"keep": 2, "forced_save_fractions": []},
    })


def bare_run(spec, ds: dict, out: str) -> tuple[float, int]:
    """The reference: a plain HF Trainer + DeepSpeed, nothing of swiftslurm but the shared data/model code."""
    import torch
    import torch.distributed as tdist
    from transformers import Trainer, set_seed

    from swiftslurm.train.build import training_arguments
    from swiftslurm.train.data.tokens import Collator, load_dataset
    from swiftslurm.train.tinymodel import build_model, build_tokenizer

    set_seed(spec.train.seed)
    args = training_arguments(spec, out, ds, cuda=False)
    tok = build_tokenizer()
    seen = {"tokens": 0}

    class CountingCollator(Collator):  # counts non-padding tokens as batches are built: no collective
        def __call__(self, batch):
            out = super().__call__(batch)
            seen["tokens"] += int(out["attention_mask"].sum())
            return out

    model = build_model(len(tok), spec.train.max_length, spec.train.seed)
    data = load_dataset(spec.train.dataset, tok, spec.train.max_length)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=CountingCollator(tok.pad_token_id),
                      processing_class=tok)
    trainer.train()
    final = trainer.state.log_history[-1]
    total = torch.tensor([seen["tokens"]], dtype=torch.float64)
    tdist.all_reduce(total)
    return final["train_runtime"], int(total.item())


def swiftslurm_run(spec, ds: dict, out: str, dist) -> float:
    from swiftslurm.train.run import train

    train(spec, dist, ds, out, None, lambda: False)
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()] if dist.rank == 0 else []
    return next((r["train_runtime"] for r in rows if "train_runtime" in r), 0.0)


def worker(args) -> None:
    import torch.distributed as tdist

    from swiftslurm.dsconfig import build_for_spec
    from swiftslurm.slurm.distenv import DistEnv

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world, node_rank=0, nnodes=1,
                   nodes=("localhost",), node="localhost", master_addr="127.0.0.1",
                   master_port=int(os.environ["MASTER_PORT"]), job_id="bench", requeue_id="bench",
                   array_task_id=None, restart_count=0, gpus=(), executor="local")
    bare, ours, tokens = [], [], 0
    for i in range(args.repeats):
        for kind in ("bare", "swiftslurm") if i % 2 == 0 else ("swiftslurm", "bare"):
            out = os.path.join(args.out, f"{kind}-{i}")
            spec = make_spec(args, out)
            ds, _ = build_for_spec(spec)
            if kind == "bare":
                runtime, tokens = bare_run(spec, ds, out)
                bare.append(runtime)
            else:
                ours.append(swiftslurm_run(spec, ds, out, dist))
            if tdist.is_initialized():
                tdist.barrier()
    if rank == 0:
        result = {"steps": args.steps, "ranks": world, "deepspeed": args.deepspeed, "tokens": tokens,
                  "bare_runtime_s": bare, "swiftslurm_runtime_s": ours,
                  "bare_tokens_per_s": tokens / min(bare), "swiftslurm_tokens_per_s": tokens / min(ours)}
        result["ratio"] = result["swiftslurm_tokens_per_s"] / result["bare_tokens_per_s"]
        Path(args.out, "result.json").write_text(json.dumps(result))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--deepspeed", default="zero2")
    ap.add_argument("--out")
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    args.out = args.out or tempfile.mkdtemp(prefix="swiftslurm-bench-")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, __file__, "--worker", "--out", args.out, "--steps", str(args.steps),
            "--repeats", str(args.repeats), "--deepspeed", args.deepspeed, "--nprocs", str(args.nprocs)]
    procs = []
    for rank in range(args.nprocs):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.nprocs),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE if rank else None,
                                      stderr=subprocess.STDOUT if rank else None, text=True))
    codes = [p.wait() for p in procs]
    if any(codes):
        print(f"benchmark failed: exit codes {codes}")
        return 1
    r = json.loads(Path(args.out, "result.json").read_text())
    print(f"\ntrain overhead, {r['ranks']} CPU ranks, {r['deepspeed']}, {r['steps']} steps, {r['tokens']} tokens per run")
    print(f"  bare HF Trainer + DeepSpeed : {r['bare_tokens_per_s']:10.1f} tokens/s  (runtimes {r['bare_runtime_s']})")
    print(f"  swiftslurm trainer          : {r['swiftslurm_tokens_per_s']:10.1f} tokens/s  (runtimes {r['swiftslurm_runtime_s']})")
    print(f"  ratio swiftslurm / bare     : {r['ratio']:.3f}  (goal >= 0.95)")
    shutil.rmtree(args.out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
