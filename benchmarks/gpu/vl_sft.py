"""Vision-language SFT (issue 56): swiftslurm's defaults vs TRL's SFTTrainer with its vision-language collator, on the
same image+text records and the same model dir, in the same run, one GPU.

    source benchmarks/gpu/setup.sh && R=$PWD && cd /tmp && python3 $R/benchmarks/gpu/vl_sft.py --work /tmp/vl --out $OUT/vl
    BENCH_CPU=1 .venv/bin/python benchmarks/gpu/vl_sft.py --family llava --tiny --steps 4 --warmup 2 --logging-steps 1 \
        --work /tmp/vl-cpu --out /tmp/vl-cpu-out     # a CPU smoke run of both arms (swiftslurm's tiny-vl, a LLaVA)

Assets (make_vl_assets.py, in a subprocess so the GPU is free again): a Qwen2.5-VL-7B-shaped model with random bf16
weights (``--tiny``: 2 layers of the same family; ``--family llava``: swiftslurm's tiny-vl), its processor at swiftslurm's
default resolution bounds (32*32 .. 768*768 pixels: 1..752 tokens an image), a few hundred generated JPEG/PNG images of
300..1200 px a side, and records in swiftslurm's format with alpaca-length text (most one image, some two, a few none).

Arms (LoRA r16 / alpha 32 / dropout 0.05 on the language model's q,k,v,o,gate,up,down; vision tower and projector
frozen; ZeRO-2 with the DeepSpeed dict ``swiftslurm plan --json`` gives; bf16; micro-batch ``--micro``; constant lr;
the same steps and ``max_length``; no sample longer than ``max_length``, so neither arm truncates):
- ``swiftslurm``: ``swiftslurm submit --executor local --wait`` on a spec that sets only the keys above (packing, kernels,
  attention, gradient checkpointing = "auto": its defaults; ``slurm.gpu_memory_gb`` from the card);
- ``trl``: bare_trl_vl.py under torchrun: TRL's SFTTrainer, its DataCollatorForVisionLanguageModeling, peft LoRA, the
  gradient checkpointing ``plan`` resolved for the swiftslurm spec, the attention swiftslurm's run reports (if TRL can
  take it by name, else sdpa).
Throughput = useful tokens of steps ``warmup+1..N`` over the wall time between the logs of steps ``warmup`` and N
(packing_e2e.throughput), where a useful token is any non-padding position: text and image tokens alike (the attention
mask's sum in both arms; swiftslurm's ``useful_tokens``). The records also give each arm's tokens per sample (the two
samplers draw different samples: a check that they saw alike data), peak GPU memory (allocated), and plan's memory
estimate and image lines for the spec. Rows go to OUT/results.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench import read_jsonl, record, sh  # noqa: E402
from packing_e2e import throughput  # noqa: E402

TRL_ATTN = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")  # names TRL's model load takes


def card_memory_gb() -> float | None:
    """The card's memory in GiB, as plan reads slurm.gpu_memory_gb (an H100 80GB: 79, an H200: 140), from nvidia-smi:
    no CUDA context in this process, which would hold GPU memory through both arms. None without a GPU."""
    try:
        res = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    mib = res.stdout.split()
    return round(int(mib[0]) / 1024) if res.returncode == 0 and mib and mib[0].isdigit() else None


def write_spec(path: Path, run_dir: Path, assets: dict, a: argparse.Namespace, cpu: bool, gpu_gb: float | None) -> None:
    train = {"model": json.dumps(assets["model_dir"]), "dataset": json.dumps([assets["data"]]), "train_type": '"lora"',
             "lora_rank": "16", "deepspeed": '"zero2"', "bf16": "false" if cpu else "true",
             "per_device_train_batch_size": str(a.micro), "learning_rate": "1e-4", "lr_scheduler_type": '"constant"',
             "max_length": str(a.max_length), "max_steps": str(a.steps), "save_steps": "100000",
             "logging_steps": str(a.logging_steps)}
    path.write_text(f"""[job]
name = "vl_sft"
output_dir = "{run_dir}"
[slurm]
{'tasks_per_node' if cpu else 'gpus_per_node'} = 1
{'' if gpu_gb is None else f'gpu_memory_gb = {gpu_gb}'}
[train]
""" + "".join(f"{k} = {v}\n" for k, v in train.items()) + """
[checkpoint]
forced_save_fractions = []
[preflight]
checks = []
""")


def plan_lines(plan: dict) -> dict:
    """plan --json's memory estimate and image lines for the spec, and the gradient checkpointing it resolved."""
    m = (plan.get("memory") or [{}])[0]
    train = (plan.get("tasks") or [{}])[0].get("spec", {}).get("train", {})
    return {"estimate_allocated_gib": m.get("allocated_gib"), "estimate_total_gib": m.get("total_gib"),
            "estimate_per_rank_gib": m.get("per_rank_gib"), "gpu_memory_gib": m.get("gpu_memory_gib"), "fits": m.get("fits"),
            "gradient_checkpointing": train.get("gradient_checkpointing"),
            "gradient_checkpointing_layers": train.get("gradient_checkpointing_layers"),
            "checkpointing_why": (m.get("gradient_checkpointing") or {}).get("why"),
            "images": (plan.get("images") or {}).get("0"), "packing_in_spec": train.get("packing"),  # packed rows: LLaVA, Qwen2-VL, Qwen2.5-VL
            "attn_implementation": train.get("attn_implementation")}


def per_sample(useful: int, samples: int | float | None) -> float | None:
    return round(useful / samples, 1) if samples else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/vl")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/vl-out"))
    ap.add_argument("--family", choices=["qwen", "llava"], default="qwen",
                    help="qwen: Qwen2.5-VL-7B-shaped (needs torchvision); llava: swiftslurm's tiny-vl (a CPU run)")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model of the family (llava: always tiny)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--logging-steps", type=int, default=10, help="every arm logs every this many steps (swiftslurm's "
                    "default); --steps and --warmup must be multiples of it")
    ap.add_argument("--micro", type=int, default=4, help="samples per micro-batch, both arms")
    ap.add_argument("--max-length", type=int, default=2048, help="train.max_length (swiftslurm's default) = TRL's max_length")
    ap.add_argument("--images", type=int, default=300)
    ap.add_argument("--samples", type=int, default=400)
    ap.add_argument("--arms", default="swiftslurm,trl")
    ap.add_argument("--gpu-memory-gb", type=float, default=None, help="slurm.gpu_memory_gb (default: the card's)")
    a = ap.parse_args()
    if a.steps % a.logging_steps or a.warmup % a.logging_steps:
        ap.error(f"--steps ({a.steps}) and --warmup ({a.warmup}) must be multiples of --logging-steps ({a.logging_steps})")
    work, out = Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    cpu = os.environ.get("BENCH_CPU") == "1"

    key = work / f"assets_{a.family}{'_tiny' if a.tiny else ''}.json"
    if not key.exists():
        argv = [sys.executable, str(HERE / "make_vl_assets.py"), str(work), "--family", a.family, "--images", str(a.images),
                "--samples", str(a.samples), "--max-length", str(a.max_length)] + (["--tiny"] if a.tiny else [])
        rc = sh(argv, out / "vl_assets.log", timeout=900)
        if rc:
            sys.exit(f"make_vl_assets.py failed (rc={rc}): see {out / 'vl_assets.log'}")
        key.write_text((out / "vl_assets.log").read_text().strip().splitlines()[-1])
    assets = json.loads(key.read_text())
    record(out, {"what": "vl_data", **{k: v for k, v in assets.items() if k != "model_dir"},
                 "model": Path(assets["model_dir"]).name})

    gpu_gb = a.gpu_memory_gb if a.gpu_memory_gb is not None else card_memory_gb()
    spec, run_dir = work / "vl_sft.toml", work / "runs" / "swiftslurm"
    write_spec(spec, run_dir, assets, a, cpu, gpu_gb)
    res = subprocess.run(["swiftslurm", "plan", str(spec), "--json"], capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"swiftslurm plan failed: {res.stderr[-2000:]}")
    plan = json.loads(res.stdout)
    planned = plan_lines(plan)
    record(out, {"what": "vl_plan", "slurm_gpu_memory_gb": gpu_gb, **planned})

    results: dict[str, dict] = {}
    attn = "sdpa"
    for arm in a.arms.split(","):
        if arm == "swiftslurm":
            shutil.rmtree(run_dir, ignore_errors=True)
            rc = sh(["swiftslurm", "submit", str(spec), "--executor", "local", "--wait"], out / "vl_swiftslurm.log", timeout=1200)
            rows = read_jsonl(run_dir / "metrics.jsonl")
            r = throughput(rows, "useful_tokens", a.warmup)
            span = [x for x in rows if a.warmup < x.get("step", 0) and "useful_tokens" in x]
            # samples of the measured steps: samples_per_s x the interval's step time (the rows log rates, not counts)
            samples = sum(x["samples_per_s"] * x["useful_tokens"] / x["useful_tokens_per_s"] for x in span
                          if x.get("samples_per_s") and x.get("useful_tokens_per_s"))
            peaks = [x["gpu_mem_peak_mb"] for x in rows if "gpu_mem_peak_mb" in x]
            reserved = [x["gpu_mem_reserved_peak_mb"] for x in rows if "gpu_mem_reserved_peak_mb" in x]
            pads = [x["padding_ratio"] for x in span if "padding_ratio" in x]
            waits = [x["data_wait_ratio"] for x in span if "data_wait_ratio" in x]
            r.update(rc=rc, tokens_per_sample=per_sample(r.get("useful_tokens", 0), samples),
                     peak_mb=round(max(peaks)) if peaks else None, reserved_peak_mb=round(max(reserved)) if reserved else None,
                     padding_ratio=round(statistics.median(pads), 4) if pads else None,
                     data_wait_ratio=round(statistics.median(waits), 4) if waits else None)
            summary = run_dir / "train-summary.json"
            if summary.exists():
                s = json.loads(summary.read_text())
                attn = s.get("attn_implementation") or attn
                r["attn"] = s.get("attn_implementation")
                r["summary"] = [ln.strip() for ln in s.get("text", "").splitlines() if any(
                    w in ln for w in ("kernel", "packing", "vision", "LoRA", "lora", "checkpointing"))][:6]
            for ckpt in run_dir.glob("checkpoint-*"):
                shutil.rmtree(ckpt, ignore_errors=True)
        elif arm == "trl":
            bare_dir = work / "bare" / "trl"
            shutil.rmtree(bare_dir, ignore_errors=True)
            ds = dict(plan["deepspeed"][0], train_micro_batch_size_per_gpu=a.micro, train_batch_size=a.micro,
                      bf16={"enabled": not cpu})
            ds_json = work / "ds_trl.json"
            ds_json.write_text(json.dumps(ds))
            trl_attn = attn if attn in TRL_ATTN else "sdpa"
            argv = ["torchrun", "--standalone", "--nproc_per_node=1", str(HERE / "bare_trl_vl.py"), "--model", assets["model_dir"],
                    "--data", assets["data"], "--ds", str(ds_json), "--steps", str(a.steps), "--out", str(bare_dir),
                    "--seq", str(a.max_length), "--micro", str(a.micro), "--logging-steps", str(a.logging_steps),
                    "--attn", trl_attn] + (["--gradient-checkpointing"] if planned["gradient_checkpointing"] else []) + \
                (["--fp32"] if cpu else [])
            rc = sh(argv, out / "vl_trl.log", timeout=1200)
            steps = read_jsonl(bare_dir / "steps.jsonl")
            r = throughput(steps, "useful", a.warmup)
            samples = sum(x.get("samples", 0) for x in steps if x["step"] > a.warmup)
            summ = json.loads((bare_dir / "summary.json").read_text()) if (bare_dir / "summary.json").exists() else {}
            peak, reserved = summ.get("gpu_mem_peak_mb"), summ.get("gpu_mem_reserved_peak_mb")
            positions = sum(x.get("positions", 0) for x in steps if x["step"] > a.warmup)
            r.update(rc=rc, padding_ratio=round(1 - r.get("useful_tokens", 0) / positions, 4) if positions else None,
                     tokens_per_sample=per_sample(r.get("useful_tokens", 0), samples),
                     peak_mb=round(peak) if peak else None, reserved_peak_mb=round(reserved) if reserved else None,
                     attn=trl_attn, gradient_checkpointing=summ.get("gradient_checkpointing"),
                     trainable_params=summ.get("trainable_params"), collator=summ.get("collator"))
            if planned["gradient_checkpointing_layers"]:  # TRL checkpoints every layer or none
                r["note"] = f"swiftslurm recomputes {planned['gradient_checkpointing_layers']} layers; TRL all of them"
        else:
            sys.exit(f"unknown arm {arm!r}: swiftslurm or trl")
        r["counted"] = "useful tokens = non-padding text + image tokens (attention mask), steps after warmup"
        if r.get("peak_mb") and planned["estimate_allocated_gib"]:
            r["peak_vs_estimate"] = round(r["peak_mb"] / 1024 / planned["estimate_allocated_gib"], 3)
        results[arm] = r
        record(out, {"what": "vl_sft", "arm": arm, "family": assets["family"], "model": Path(assets["model_dir"]).name, **r})
    ours, theirs = (results.get(arm, {}).get("useful_tokens_s") for arm in ("swiftslurm", "trl"))
    mem = [results.get(arm, {}).get("peak_mb") for arm in ("swiftslurm", "trl")]
    record(out, {"what": "vl_sft_ratio", "swiftslurm_vs_trl": round(ours / theirs, 3) if ours and theirs else None,
                 "peak_mb_swiftslurm_vs_trl": round(mem[0] / mem[1], 3) if all(mem) else None, "goal": ">= 1.3 (issue 56)"})


if __name__ == "__main__":
    main()
