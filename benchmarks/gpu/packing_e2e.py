"""Alpaca-length data end to end (issue 19): swiftslurm with its defaults vs a bare HF Trainer + DeepSpeed
with HF's default dynamic padding, and the same model on full rows, in the same run, one GPU.

    source benchmarks/gpu/setup.sh
    python3 benchmarks/gpu/packing_e2e.py --work /tmp/pk --out $OUT [--steps 60] [--probe] [--profile 22:24]
    BENCH_CPU=1 .venv/bin/python benchmarks/gpu/packing_e2e.py --tiny --steps 6 --warmup 2 --logging-steps 2   # a CPU smoke run

Arms (same model dir: the Qwen2.5-0.5B-shaped Llama of make_assets.py, bf16, ZeRO-2, no gradient
checkpointing, AdamW, constant lr, the same DeepSpeed dict, which `swiftslurm plan` merged):
- ``padded``: bare_trainer.py --hf-collator, micro-batch 8 samples, each padded to its batch's longest (sdpa);
- ``swiftslurm``: ``swiftslurm submit --executor local --wait`` on a spec that sets only what the bare arm
  sets too (model, data, zero2, bf16, lr, steps, micro-batch 4): packing, attention and kernels are the
  defaults (rows of ``train.max_length`` = 2048 tokens, 4 rows per micro-batch);
- ``full_rows``: bare_trainer.py on samples that each fill a whole 2048-token row, micro-batch 4 (no padding).

The samples of ``padded`` and ``swiftslurm`` are the same file: alpaca-like records whose encoded lengths are
log-normal (median ~220 tokens, capped at 2048). Throughput = useful (non-padding) tokens of steps
``warmup+1..N`` over the wall time between the logs of step ``warmup`` and step N, the same for every arm.
Every arm logs every ``--logging-steps`` steps (10, swiftslurm's default; each log syncs the GPU).
MFU = 6 x params x useful tokens/s / 989 TFLOP/s (H200 bf16 dense). Rows go to OUT/results.jsonl.
``--probe`` adds each arm's median forward / backward / optimizer-step / between-steps times (host and GPU,
probe/sitecustomize.py); ``--profile A:B`` also writes torch.profiler tables of steps A..B-1 beside them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench import read_jsonl, record, sh  # noqa: E402

H200_BF16_TFLOPS = 989.0
# swiftslurm arms: what each sets in [train] beyond the common keys (the first is the defaults)
VARIANTS = {
    "swiftslurm": lambda assets: {},
    "swiftslurm_defaults": lambda assets: {"gradient_checkpointing": None},  # None: the key left out (its default, "auto")
    "swiftslurm_ckpt": lambda assets: {"gradient_checkpointing": "true"},  # the default before issue #34
    # the first k decoder layers recompute (gradient_checkpointing_layers); of the 8B shape's 32: a half, a quarter, an eighth
    "swiftslurm_layers16": lambda assets: {"gradient_checkpointing": "true", "gradient_checkpointing_layers": "16"},
    "swiftslurm_layers8": lambda assets: {"gradient_checkpointing": "true", "gradient_checkpointing_layers": "8"},
    "swiftslurm_layers4": lambda assets: {"gradient_checkpointing": "true", "gradient_checkpointing_layers": "4"},
    "swiftslurm_layers24": lambda assets: {"gradient_checkpointing": "true", "gradient_checkpointing_layers": "24"},
    "swiftslurm_compile": lambda assets: {"gradient_checkpointing": None, "compile": "true"},  # the defaults + regional compile
    # train.fp8 (issue 53): torchao float8 on the large projections, the decoder layers compiled (Liger auto-off with it)
    "swiftslurm_fp8": lambda assets: {"gradient_checkpointing": None, "fp8": "true"},
    "swiftslurm_fp8_rowwise": lambda assets: {"gradient_checkpointing": None, "fp8": "true", "fp8_recipe": '"rowwise"'},
    "swiftslurm_fp8_nockpt": lambda assets: {"gradient_checkpointing": "false", "fp8": "true"},
    "swiftslurm_nockpt": lambda assets: {"gradient_checkpointing": "false"},
    "swiftslurm_compile_noliger": lambda assets: {"gradient_checkpointing": None, "compile": "true", "use_liger_kernel": "false"},
    "swiftslurm_dsnorm": lambda assets: {"gradient_checkpointing": None},  # the defaults, DeepSpeed's own grad norm (ARM_PATH)
    "swiftslurm_syncs": lambda assets: {"gradient_checkpointing": None},  # the defaults with two host syncs a step put back (ARM_PATH)
    "swiftslurm_torchnorm": lambda assets: {"gradient_checkpointing": None},  # the defaults, torch's fused RMSNorm for Liger's (ARM_PATH)
    "swiftslurm_nocontig": lambda assets: {"gradient_checkpointing": None},  # the defaults + DS_EXTRA below
    "swiftslurm_torchnorm_nocontig": lambda assets: {"gradient_checkpointing": None},  # both of the above
    "swiftslurm_contig": lambda assets: {"gradient_checkpointing": None},  # the defaults + DS_EXTRA below
    "swiftslurm_micro8": lambda assets: {"gradient_checkpointing": None, "per_device_train_batch_size": "8"},  # twice the rows per step
    "swiftslurm_micro16": lambda assets: {"gradient_checkpointing": None, "per_device_train_batch_size": "16"},  # 4x the rows per step
    "swiftslurm_peftlora": lambda assets: {"gradient_checkpointing": None, "fused_lora": "false"},  # the defaults with peft's LoRA forward
    "swiftslurm_nodrop": lambda assets: {"gradient_checkpointing": None, "lora_dropout": "0.0"},  # the defaults without LoRA dropout
    "swiftslurm_rows8k": lambda assets: {"max_length": "8192", "per_device_train_batch_size": "1"},  # one 8192-token row
    # saves every 10 steps: today's save (rank 0 writes from its module) and the Trainer's own (ARM_PATH), issue 54
    "swiftslurm_save": lambda assets: {"gradient_checkpointing": None, "save_steps": "10"},
    "swiftslurm_save_trainerpath": lambda assets: {"gradient_checkpointing": None, "save_steps": "10"},
    # issue 54: a save every 10 steps, synchronous vs in the background (CKPT_EXTRA); --logging-steps 1 for the stalls
    "swiftslurm_save_sync": lambda assets: {"gradient_checkpointing": None, "save_steps": "10"},
    "swiftslurm_save_async": lambda assets: {"gradient_checkpointing": None, "save_steps": "10"},
    "swiftslurm_rows8k_sdpa": lambda assets: {"max_length": "8192", "per_device_train_batch_size": "1", "attn_implementation": '"sdpa"'},
    "swiftslurm_flex": lambda assets: {"attn_implementation": '"flex_attention"'},
    "swiftslurm_sdpa": lambda assets: {"attn_implementation": '"sdpa"'},  # packed-sequence mask through sdpa
    "swiftslurm_varlen": lambda assets: {"attn_implementation": '"varlen_attn"'},  # torch's flash kernel for packed samples
    "swiftslurm_liger": lambda assets: {"use_liger_kernel": "true"},  # the defaults + all of Liger (its fused loss too)
    "swiftslurm_noliger": lambda assets: {"use_liger_kernel": "false"},  # the defaults without Liger's kernels
    "swiftslurm_full_rows": lambda assets: {"dataset": json.dumps([assets["data"]])},  # the full_rows data: our overhead
    "swiftslurm_zero2_fast": lambda assets: {"deepspeed": '"zero2_fast"'},
    "swiftslurm_zero0": lambda assets: {"deepspeed": '"zero0"'},  # DeepSpeed's bf16 optimizer, no partitioning
    "swiftslurm_nods": lambda assets: {"deepspeed": '"none"'},  # plain torch AdamW, no DeepSpeed (bf16 weights)
    "swiftslurm_zero1": lambda assets: {"deepspeed": '"zero1"'},
    "swiftslurm_nocheck": lambda assets: {},  # + DS_EXTRA below
    "swiftslurm_tsync_on": lambda assets: {"gradient_checkpointing": None},  # the defaults + DS_EXTRA below
    "swiftslurm_stepsync": lambda assets: {"gradient_checkpointing": None},  # the defaults + a device sync per step (ARM_ENV)
}
# [deepspeed] overrides of an arm (merged into its preset by swiftslurm)
DS_EXTRA = {
    # DeepSpeed's per-parameter inf/NaN scan before each bf16 step, off (a non-finite step is then applied, not skipped)
    "swiftslurm_nocheck": "[deepspeed.bf16]\ncheck_grad_overflow = false\n",
    # DeepSpeed's throughput timer with its two device syncs per step (the forward's start, the step's end): DeepSpeed's
    # default, which swiftslurm turns off
    "swiftslurm_tsync_on": "[deepspeed.timers.throughput]\nsynchronized = true\n",
    # ZeRO-2 without the copy of each gradient into the reduce bucket as it is produced: on one rank a gradient hook
    # then does bookkeeping only (~13 ms of host time per 290-tensor step on the CPU, half of it the copies' dispatch)
    "swiftslurm_nocontig": "[deepspeed.zero_optimization]\ncontiguous_gradients = false\n",
    "swiftslurm_torchnorm_nocontig": "[deepspeed.zero_optimization]\ncontiguous_gradients = false\n",
    # the one-rank default before the eighth run (dsconfig.one_rank turns it off on one rank)
    "swiftslurm_contig": "[deepspeed.zero_optimization]\ncontiguous_gradients = true\n",
}
# [checkpoint] keys of an arm (keep = 2, the least: a 1.5B full fine-tune's save is ~24 GB of a 64 GB disk)
# the MoE shape's LoRA in every arm: its attention. peft takes a name that matches a fused expert weight (down_proj) as
# a ParamWrapper target, which refuses dropout: the bare arms' list would adapt different weights than "all-linear"
MOE_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
# keep = 2 (the least): a 1.5B full fine-tune's save is 24 GB of the GPU machine's 64 GB disk, so --steps 20 (saves at 10 and 20)
CKPT_EXTRA = {"swiftslurm_save_sync": "async_save = false\nkeep = 2\n", "swiftslurm_save_async": "async_save = true\nkeep = 2\n"}
# environment of an arm: the probe (probe/sitecustomize.py) syncs the device after every optimizer step, as the host
# reads swiftslurm took out of the step (grad norm, stop flag, token counts, blocking batch copy) each did
ARM_ENV = {"swiftslurm_stepsync": {"PHASE_PROBE_STEP_SYNC": "1"}}
# an arm run with a sitecustomize of its own on PYTHONPATH (no probe): dsnorm/ puts DeepSpeed's per-gradient norm back
ARM_PATH = {"swiftslurm_dsnorm": HERE / "dsnorm", "swiftslurm_syncs": HERE / "syncs", "swiftslurm_torchnorm": HERE / "torchnorm",
            "swiftslurm_torchnorm_nocontig": HERE / "torchnorm", "swiftslurm_save_trainerpath": HERE / "savepath"}


def alpaca_like(path: Path, n: int, seed: int = 0) -> None:
    """Records whose encoded length (byte-level tokenizer: ~1 token per character, plus the template's) is
    log-normal with median ~220 and is capped by max_length at encoding time."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz     "
    with open(path, "w") as fh:
        for _ in range(n):
            length = max(16, min(2100, int(rng.lognormvariate(5.4, 0.6))) - 30)
            prompt = max(4, int(length * 0.3))
            fh.write(json.dumps({"instruction": "".join(rng.choice(letters) for _ in range(prompt)), "input": "",
                                 "output": "".join(rng.choice(letters) for _ in range(length - prompt))}) + "\n")


def throughput(rows: list[dict], useful_key: str, warmup: int) -> dict:
    rows = sorted((r for r in rows if "loss" in r), key=lambda r: r["step"])
    by_step = {r["step"]: r for r in rows}
    last = max(by_step, default=0)
    if warmup not in by_step or last <= warmup:
        return {}
    span = [by_step[s] for s in range(warmup + 1, last + 1) if s in by_step]
    useful = sum(r.get(useful_key) or 0 for r in span)
    wall = by_step[last]["time"] - by_step[warmup]["time"]
    # each logging interval's own rate (min / median / max): how steady the run was, beside its mean
    marks = [by_step[warmup]] + span
    rates = sorted((r.get(useful_key) or 0) / (r["time"] - p["time"]) for p, r in itertools.pairwise(marks) if r["time"] > p["time"])
    return {"steps": len(span), "useful_tokens": int(useful), "wall_s": round(wall, 2),
            "useful_tokens_s": round(useful / wall) if wall > 0 else None,
            "interval_tokens_s": [round(rates[0]), round(statistics.median(rates)), round(rates[-1])] if rates else None}


def save_stalls(rows: list[dict]) -> dict:
    """What each save cost the training (the run logs every step): the gap between the loss rows of steps s and s+1
    around a save after step s, minus the median gap of steps 3 or more away from any save (the normal step); and,
    for a background save, the steps that ran while it was written (s+2 up to the step whose log carries its
    ``checkpoint_step``) with their median gap over the normal one. The run's last save (nothing after it) is left out."""
    times = {r["step"]: r["time"] for r in rows if "loss" in r}
    gaps = {s: times[s] - times[s - 1] for s in times if s - 1 in times}
    saved = sorted({r["step"] for r in rows if "checkpoint_stall_s" in r})
    far = [g for s, g in gaps.items() if all(not 0 <= s - v - 1 < 3 for v in saved)]
    normal = statistics.median(far) if far else None
    out = []
    for v in saved:
        if v + 1 not in gaps or normal is None:
            continue
        logged = next(r for r in rows if r["step"] == v and "checkpoint_stall_s" in r)
        done = next((r["step"] for r in rows if r.get("checkpoint_step") == v), None)
        during = [gaps[s] for s in range(v + 2, (done or v + 1) + 1) if s in gaps]
        out.append({"step": v, "stall_s": round(gaps[v + 1] - normal, 3), "logged_stall_s": round(logged["checkpoint_stall_s"], 3),
                    "save_s": round(next((r["checkpoint_save_s"] for r in rows if r.get("checkpoint_step") == v), logged.get("checkpoint_save_s", 0)), 3),
                    "steps_during_write": len(during),
                    "step_ratio_during_write": round(statistics.median(during) / normal, 3) if during else None})
    return {"normal_step_s": round(normal, 4) if normal else None, "saves": out}


def phases(path: Path, warmup: int) -> dict:
    """Medians of the probe's per-step rows after warm-up: host and GPU ms of forward, backward, optimizer step,
    the host gap between steps (trainer loop) and the GPU's idle time before each phase."""
    rows = [r for r in read_jsonl(path) if r.get("i", 0) > warmup] if path.exists() else []
    keys = sorted({k for r in rows for k in r if k != "i"})
    return {k: round(statistics.median(v), 2) for k in keys if (v := [r[k] for r in rows if r.get(k) is not None])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/pk")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/pk-out"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--samples", type=int, default=12000)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--logging-steps", type=int, default=10, help="every arm logs (and syncs for it) every this many steps: "
                    "swiftslurm's default; --steps and --warmup must be multiples of it")
    ap.add_argument("--probe", action="store_true", help="time each step's forward/backward/optimizer step "
                    "(probe/sitecustomize.py) into OUT/probe_<arm>.jsonl")
    ap.add_argument("--profile", default="", help="A:B: also torch.profiler over steps A..B-1 (implies --probe)")
    ap.add_argument("--arms", default="padded,swiftslurm,full_rows", help=f"of padded, full_rows, trl_packed, {', '.join(VARIANTS)}")
    ap.add_argument("--shape", choices=["0.5b", "1.5b", "3b", "8b", "moe"], default="0.5b",
                    help="make_assets.py's model (8b: Llama-3-8B-shaped; moe: an OLMoE-1B-7B-sized Qwen3-MoE)")
    ap.add_argument("--lora", action="store_true", help="LoRA r16 on every linear layer (all arms) instead of full fine-tuning")
    ap.add_argument("--max-length", type=int, default=2048, help="tokens per row (packed rows, full rows, TRL's packing)")
    ap.add_argument("--micro", type=int, default=4, help="rows per micro-batch (the padded arm: 2x this many samples)")
    ap.add_argument("--gpu-memory-gb", type=float, default=None, help="slurm.gpu_memory_gb of the swiftslurm specs (H200: 141)")
    a = ap.parse_args()
    work, out = Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    if a.steps % a.logging_steps or a.warmup % a.logging_steps:
        ap.error(f"--steps ({a.steps}) and --warmup ({a.warmup}) must be multiples of --logging-steps ({a.logging_steps})")
    cpu = os.environ.get("BENCH_CPU") == "1"
    if not (work / "assets.json").exists():
        argv = [sys.executable, str(HERE / "make_assets.py"), str(work), "--samples", "512", "--shape", a.shape,
                "--seq", str(a.max_length)] + (["--tiny"] if a.tiny else [])
        res = subprocess.run(argv, capture_output=True, text=True, check=True)
        (work / "assets.json").write_text(res.stdout.strip().splitlines()[-1])
    assets = json.loads((work / "assets.json").read_text())
    data = work / "alpaca_like.jsonl"
    if not data.exists():
        alpaca_like(data, a.samples)

    from transformers import AutoTokenizer

    from swiftslurm.train.data.tokens import load_dataset

    lengths = load_dataset([str(data)], AutoTokenizer.from_pretrained(assets["model_dir"]), a.max_length).lengths()
    record(out, {"what": "data", "samples": len(lengths), "median_tokens": statistics.median(lengths),
                 "mean_tokens": round(statistics.mean(lengths), 1), "max_tokens": max(lengths)})

    moe_targets = ["--lora-targets", ",".join(MOE_LORA_TARGETS)] if a.lora and a.shape == "moe" else []

    def write_spec(arm: str) -> tuple[Path, Path]:
        train = {"model": json.dumps(assets["model_dir"]), "dataset": json.dumps([str(data)]),
                 "train_type": '"lora"' if a.lora else '"full"', **({"lora_rank": "16"} if a.lora else {}),
                 # the MoE shape: the same targets in every arm (MOE_LORA_TARGETS)
                 **({"lora_target_modules": json.dumps(MOE_LORA_TARGETS)} if a.lora and a.shape == "moe" else {}),
                 "deepspeed": '"zero2"', "bf16": "false" if cpu else "true", "gradient_checkpointing": "false",
                 "per_device_train_batch_size": str(a.micro), "learning_rate": "1e-4", "lr_scheduler_type": '"constant"',
                 "max_length": str(a.max_length), "max_steps": str(a.steps), "save_steps": "100000", "logging_steps": str(a.logging_steps)}
        train.update(VARIANTS[arm](assets))
        train = {k: v for k, v in train.items() if v is not None}
        run_dir = work / "runs" / arm
        spec = work / f"{arm}.toml"
        spec.write_text(f"""
[job]
name = "{arm}"
output_dir = "{run_dir}"
[slurm]
{'tasks_per_node' if cpu else 'gpus_per_node'} = 1
{'' if a.gpu_memory_gb is None else f'gpu_memory_gb = {a.gpu_memory_gb}'}
[train]
""" + "".join(f"{k} = {v}\n" for k, v in train.items()) + """
[checkpoint]
forced_save_fractions = []
""" + CKPT_EXTRA.get(arm, "") + """[preflight]
checks = []
""" + DS_EXTRA.get(arm, ""))
        return spec, run_dir

    plan = json.loads(subprocess.run(["swiftslurm", "plan", str(write_spec("swiftslurm")[0]), "--json"], capture_output=True, text=True,
                                     check=True).stdout)
    params = assets.get("active_params", assets["params"])  # FLOPs per token: an MoE's active parameters, not its total
    results: dict[str, dict] = {}
    for n, arm in enumerate(a.arms.split(",")):
        env = None
        probed = bool(a.probe or a.profile or (arm in ARM_ENV and arm not in ARM_PATH))
        if arm in ARM_PATH and not probed:  # its own sitecustomize (under the probe, the probe's runs it: PHASE_PROBE_ARM)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ARM_PATH[arm]), os.environ.get("PYTHONPATH")])))
        if probed:
            env = dict(os.environ, PHASE_PROBE_OUT=str(out / f"probe_{n}_{arm}.jsonl"), PHASE_PROBE_PROFILE=a.profile,
                       PYTHONPATH=os.pathsep.join(filter(None, [str(HERE / "probe"), os.environ.get("PYTHONPATH")])),
                       **ARM_ENV.get(arm, {}),
                       **({"PHASE_PROBE_ARM": str(ARM_PATH[arm] / "sitecustomize.py")} if arm in ARM_PATH else {}))
        if arm in VARIANTS:
            spec, run_dir = write_spec(arm)
            shutil.rmtree(run_dir, ignore_errors=True)
            rc = sh(["swiftslurm", "submit", str(spec), "--executor", "local", "--wait"], out / f"pk_{arm}.log", env=env, timeout=1200)
            rows = read_jsonl(run_dir / "metrics.jsonl")
            res = throughput(rows, "useful_tokens", a.warmup)
            peaks = [r["gpu_mem_peak_mb"] for r in rows if "gpu_mem_peak_mb" in r]
            reserved = [r["gpu_mem_reserved_peak_mb"] for r in rows if "gpu_mem_reserved_peak_mb" in r]
            pads = [r["padding_ratio"] for r in rows if "padding_ratio" in r]
            waits = [r["data_wait_ratio"] for r in rows if r.get("step", 0) > a.warmup and "data_wait_ratio" in r]
            # each save's seconds and phases (checkpoint_<phase>_s); a background save's rows at the save (stall, copy,
            # wait) and at its commit, and the pinning of its buffers after the first step (checkpoint_pin_s)
            saves = [r for r in rows if any(k.startswith("checkpoint_") for k in r)]
            losses = [(r["step"], round(r["loss"], 4)) for r in rows if r.get("loss") is not None and "step" in r]
            if losses:  # the loss curve (FP8 beside bf16 on the same records: issue 53's parity check)
                res["loss_curve"] = losses
            routed = [r for r in rows if "router_load_max" in r]  # an MoE model: its router's balance, first and last log
            if routed:
                res["router_load_max"] = [round(routed[0]["router_load_max"], 3), round(routed[-1]["router_load_max"], 3),
                                          routed[-1].get("router_load_limit")]
            if any("checkpoint_stall_s" in r for r in rows):
                res["stalls"] = save_stalls(rows)
            if saves:
                res["saves"] = [{"step": r.get("step"), **{k: round(v, 2) for k, v in r.items()
                                                            if k.startswith("checkpoint_") and isinstance(v, (int, float))}}
                                for r in saves]
                rss = [r["cpu_rss_mb"] for r in rows if "cpu_rss_mb" in r]
                res["cpu_rss_mb_max"] = round(max(rss)) if rss else None
            res.update(rc=rc, peak_mb=round(max(peaks)) if peaks else None, reserved_peak_mb=round(max(reserved)) if reserved else None,
                       padding_ratio=round(statistics.median(pads), 4) if pads else None,
                       data_wait_ratio=round(statistics.median(waits), 4) if waits else None)
            summary = run_dir / "train-summary.json"
            if summary.exists():
                res["attn"] = json.loads(summary.read_text()).get("attn_implementation")
                res["summary"] = json.loads(summary.read_text()).get("text", "").splitlines()[3:4]  # the kernels line
            for ckpt in run_dir.glob("checkpoint-*"):  # the run's last save: a 3B full fine-tune's is ~48 GB of a 64 GB disk
                shutil.rmtree(ckpt, ignore_errors=True)
            # plan's estimate for this arm beside the measured peak, and what "auto" checkpointing resolved to
            arm_plan = json.loads(subprocess.run(["swiftslurm", "plan", str(spec), "--json"], capture_output=True, text=True).stdout or "{}")
            m = (arm_plan.get("memory") or [{}])[0]
            res.update(estimate_allocated_gib=m.get("allocated_gib"), estimate_total_gib=m.get("total_gib"),
                       gradient_checkpointing=(arm_plan.get("tasks") or [{}])[0].get("spec", {}).get("train", {}).get("gradient_checkpointing"),
                       checkpointing_layers=(arm_plan.get("tasks") or [{}])[0].get("spec", {}).get("train", {}).get("gradient_checkpointing_layers"),
                       checkpointing_why=(m.get("gradient_checkpointing") or {}).get("why"))
        elif arm == "trl_packed":  # TRL's SFTTrainer with its own packing (BFD, padding-free) on the same records
            bare_dir = work / "bare" / arm
            shutil.rmtree(bare_dir, ignore_errors=True)
            ds = dict(plan["deepspeed"][0], train_micro_batch_size_per_gpu=a.micro, train_batch_size=a.micro, bf16={"enabled": True})
            ds_json = work / f"ds_{arm}.json"
            ds_json.write_text(json.dumps(ds))
            argv = ["torchrun", "--standalone", "--nproc_per_node=1", str(HERE / "bare_trl_sft.py"), "--model", assets["model_dir"],
                    "--ds", str(ds_json), "--steps", str(a.steps), "--out", str(bare_dir), "--seq", str(a.max_length),
                    "--micro", str(a.micro), "--data", str(data), "--logging-steps", str(a.logging_steps)] + (["--lora"] if a.lora else []) + moe_targets
            rc = sh(argv, out / f"pk_{arm}.log", env=env, timeout=1200)
            res = throughput(read_jsonl(bare_dir / "steps.jsonl"), "useful", a.warmup)
            summ = bare_dir / "summary.json"
            peak = json.loads(summ.read_text()).get("gpu_mem_peak_mb") if summ.exists() else None
            res.update(rc=rc, peak_mb=round(peak) if peak else None)
        else:
            bare_dir = work / "bare" / arm
            shutil.rmtree(bare_dir, ignore_errors=True)
            micro = 2 * a.micro if arm == "padded" else a.micro
            ds = dict(plan["deepspeed"][0], train_micro_batch_size_per_gpu=micro, train_batch_size=micro, bf16={"enabled": True})
            ds_json = work / f"ds_{arm}.json"
            ds_json.write_text(json.dumps(ds))
            argv = ["torchrun", "--standalone", "--nproc_per_node=1", str(HERE / "bare_trainer.py"), "--model", assets["model_dir"],
                    "--ds", str(ds_json), "--steps", str(a.steps), "--out", str(bare_dir), "--seq", str(a.max_length),
                    "--logging-steps", str(a.logging_steps)] + (["--lora"] if a.lora else []) + moe_targets
            argv += (["--data", str(data), "--hf-collator"] if arm == "padded" else ["--data", assets["data"]]) + ["--micro", str(micro)]
            rc = sh(argv, out / f"pk_{arm}.log", env=env, timeout=1200)
            res = throughput(read_jsonl(bare_dir / "steps.jsonl"), "useful", a.warmup)
            summ = bare_dir / "summary.json"
            peak = json.loads(summ.read_text()).get("gpu_mem_peak_mb") if summ.exists() else None
            res.update(rc=rc, peak_mb=round(peak) if peak else None)
        if res.get("useful_tokens_s"):  # LoRA: no weight gradients of the frozen base, 4 x params per token
            res["mfu"] = round((4 if a.lora else 6) * params * res["useful_tokens_s"] / (H200_BF16_TFLOPS * 1e12), 4)
        if probed:
            res["phases_ms"] = phases(out / f"probe_{n}_{arm}.jsonl", a.warmup)
        results[arm] = res
        record(out, {"what": "packing_e2e", "arm": arm, **res})
    ours_arm = next((arm for arm in a.arms.split(",") if arm in ("swiftslurm", "swiftslurm_defaults")), "swiftslurm")
    ours = results.get(ours_arm, {}).get("useful_tokens_s")
    ratios = {"ours": ours_arm}
    for base in ("padded", "full_rows", "trl_packed", "swiftslurm_ckpt"):
        theirs = results.get(base, {}).get("useful_tokens_s")
        if ours and theirs:
            ratios[f"swiftslurm_vs_{base}"] = round(ours / theirs, 3)
    sync, background = (results.get(arm, {}).get("stalls", {}).get("saves") for arm in ("swiftslurm_save_sync", "swiftslurm_save_async"))
    if sync and background:  # the same save points: the background save's stall over the synchronous one's, each save
        ratios["async_vs_sync_stall"] = [round(b["stall_s"] / s["stall_s"], 3) for s, b in zip(sync, background, strict=False) if s["stall_s"] > 0]
    record(out, {"what": "packing_e2e_ratios", **ratios})


if __name__ == "__main__":
    main()
