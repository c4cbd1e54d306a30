"""DPO and GaLore on one H200, measured in the same run (issue 16). On the GPU machine:

    source benchmarks/gpu/setup.sh
    python3 benchmarks/gpu/dpo_galore.py all --work /tmp/bench16 --out $OUT          # everything
    python3 benchmarks/gpu/dpo_galore.py dpo|galore|report --work ... --out ...       # one part

- dpo: DPO LoRA (ZeRO-2, 1 GPU, bf16) through the user's path (`swiftslurm submit --executor local --wait`)
  vs a bare TRL DPOTrainer + DeepSpeed script (bare_dpo.py) on the same model dir, the same preference
  JSONL and the same DeepSpeed dict: tokens/s from the median step time (the same method for both).
- galore: full fine-tuning of a Qwen2.5-0.5B shape (and 1.5B with --shapes 0.5b,1.5b) on the plain DDP path
  (deepspeed = "none", 1 GPU, bf16 weights) with optimizer adamw vs galore_adamw (rank 64) vs apollo_adamw
  (rank 64): peak GPU memory and tokens/s, all through swiftslurm.

Models are random-init from a config (make_assets.py; no download). Rows go to OUT/results16.jsonl;
`report` prints the Markdown tables of docs/benchmarks.md. A CPU smoke run of the driver:
    BENCH_CPU=1 python3 benchmarks/gpu/dpo_galore.py all --tiny --steps 6 --work /tmp/b16 --out /tmp/b16/out
"""

from __future__ import annotations

import json
import os
import random
import shutil
import string
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench import LORA_TARGETS, read_jsonl, sh, step_stats  # noqa: E402  (the same helpers as bench.py)

RESULTS = "results16.jsonl"
SHAPES = {  # Qwen2.5 shapes (random init), and a tiny one for the CPU smoke run
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512),
}
OPTIMIZERS = ("adamw", "galore_adamw", "apollo_adamw")


def record(out: Path, row: dict) -> None:
    with open(out / RESULTS, "a") as fh:
        fh.write(json.dumps(row) + "\n")
    print("  " + json.dumps(row), flush=True)


def cpu() -> bool:
    return os.environ.get("BENCH_CPU") == "1"


def model_dir(work: Path, shape: str) -> Path:
    """A random-init Llama of ``shape`` saved with swiftslurm's byte-level tokenizer (built once)."""
    path = work / f"model-{shape}"
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from swiftslurm.train.tinymodel import build_tokenizer

    tok = build_tokenizer()
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def data(work: Path, seq: int, samples: int = 512) -> tuple[Path, Path, int]:
    """(preference JSONL, SFT JSONL, tokens per pair): fixed-length random text (one byte = one token), so every
    step sees the same token count. A pair is prompt + chosen and prompt + rejected: 2 * (P + C + 1) tokens."""
    prompt_len, completion_len = seq // 4, seq // 2
    pref, sft = work / f"dpo-{seq}.jsonl", work / f"sft-{seq}.jsonl"
    if not pref.exists():
        rng = random.Random(0)
        text = lambda n: "".join(rng.choice(string.ascii_lowercase + "    ") for _ in range(n))  # noqa: E731
        with open(pref, "w") as fp, open(sft, "w") as fs:
            for _ in range(samples):
                p, c, r = text(prompt_len), text(completion_len), text(completion_len)
                fp.write(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n")
                fs.write(json.dumps({"instruction": p, "input": "", "output": c + r}) + "\n")
    return pref, sft, 2 * (prompt_len + completion_len + 1)


def spec(work: Path, name: str, model: Path, dataset: Path, steps: int, micro: int, seq: int, **train) -> Path:
    lines = [
        "[job]", f'name = "{name}"', f'output_dir = "{work / "runs" / name}"',
        "[slurm]", f"{'tasks_per_node' if cpu() else 'gpus_per_node'} = 1", 'time = "01:00:00"', "signal_grace_s = 60",
        "[train]", f'model = "{model}"', f'dataset = ["{dataset}"]', f"bf16 = {'false' if cpu() else 'true'}",
        "gradient_checkpointing = false", f"per_device_train_batch_size = {micro}", 'lr_scheduler_type = "constant"',
        f"max_steps = {steps}", f"max_length = {seq}", "save_steps = 100000", "logging_steps = 1",
    ] + [f"{k} = {json.dumps(v)}" for k, v in train.items()] + [
        "[checkpoint]", "keep = 2", "forced_save_fractions = []", "[preflight]", "checks = []",
    ]
    path = work / "specs" / f"{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def submit(work: Path, out: Path, spec_path: Path, name: str) -> tuple[int, list[dict]]:
    run_dir = work / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    rc = sh(["swiftslurm", "submit", str(spec_path), "--executor", "local", "--wait"], out / f"{name}_swiftslurm.log", timeout=1800)
    for f in ("metrics.jsonl", "train-summary.json"):
        if (run_dir / f).exists():
            shutil.copy(run_dir / f, out / f"{name}_{f}")
    return rc, read_jsonl(run_dir / "metrics.jsonl")


def peak_mb(rows: list[dict]) -> int | None:
    peaks = [r["gpu_mem_peak_mb"] for r in rows if "gpu_mem_peak_mb" in r]
    return round(max(peaks)) if peaks else None


def dpo(work: Path, out: Path, shape: str, steps: int, micro: int, seq: int) -> None:
    model = model_dir(work, shape)
    pref, _, pair_tokens = data(work, seq)
    name = f"dpo-lora-{shape}"
    spec_path = spec(work, name, model, pref, steps, micro, seq, task="dpo", train_type="lora", deepspeed="zero2",
                     learning_rate=1e-5, lora_rank=16, lora_alpha=32, lora_target_modules=LORA_TARGETS)
    plan = json.loads(subprocess.run(["swiftslurm", "plan", str(spec_path), "--json"], capture_output=True, text=True, check=True).stdout)
    ds_json = work / f"{name}.ds.json"
    ds_json.write_text(json.dumps(plan["deepspeed"][0]))  # the bare script gets exactly swiftslurm's DeepSpeed dict
    bare_dir = work / "bare" / name
    shutil.rmtree(bare_dir, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    rc_b = sh(["torchrun", "--standalone", "--nproc_per_node=1", str(HERE / "bare_dpo.py"), "--model", str(model), "--data", str(pref),
               "--ds", str(ds_json), "--steps", str(steps), "--micro", str(micro), "--seq", str(seq), "--out", str(bare_dir), "--lora"],
              out / f"{name}_bare.log", env=env, timeout=1800)
    rc_s, ours = submit(work, out, spec_path, name)
    b, o = step_stats(read_jsonl(bare_dir / "steps.jsonl"), first=3, last=steps), step_stats(ours, first=3, last=steps)
    row = {"what": "dpo", "run": name, "gpus": 1, "deepspeed": "zero2", "lora": True, "rc_bare": rc_b, "rc_swiftslurm": rc_s,
           "tokens_per_step": micro * pair_tokens}
    if b and o:
        row.update({"bare_tokens_s": round(micro * pair_tokens / b["step_ms_median"] * 1000),
                    "swiftslurm_tokens_s": round(micro * pair_tokens / o["step_ms_median"] * 1000),
                    "ratio": round(b["step_ms_median"] / o["step_ms_median"], 3),
                    "bare_step_ms": [b["step_ms_median"], b["step_ms_p90"]], "swiftslurm_step_ms": [o["step_ms_median"], o["step_ms_p90"]]})
    if (bare_dir / "summary.json").exists():
        row["bare_peak_mb"] = json.loads((bare_dir / "summary.json").read_text())["gpu_mem_peak_mb"]
    row["swiftslurm_peak_mb"] = peak_mb(ours)
    acc = [r["rewards/accuracies"] for r in ours if "rewards/accuracies" in r]
    row["swiftslurm_last_reward_accuracy"] = acc[-1] if acc else None
    record(out, row)


def galore(work: Path, out: Path, shape: str, steps: int, micro: int, seq: int, rank: int) -> None:
    model = model_dir(work, shape)
    _, sft, _ = data(work, seq)
    for optimizer in OPTIMIZERS:
        name = f"full-{shape}-{optimizer}"
        extra = {} if optimizer == "adamw" else {"galore_rank": rank, "galore_update_proj_gap": 200}
        spec_path = spec(work, name, model, sft, steps, micro, seq, train_type="full", deepspeed="none", packing=False,
                         learning_rate=1e-5, optimizer=optimizer, **extra)
        rc, ours = submit(work, out, spec_path, name)
        o = step_stats(ours, first=3, last=steps)
        row = {"what": "galore", "run": name, "shape": shape, "optimizer": optimizer, "rank": extra.get("galore_rank"),
               "rc_swiftslurm": rc, "peak_mb": peak_mb(ours)}
        tokens = [r["useful_tokens"] for r in ours if "useful_tokens" in r]
        if o and tokens:
            row.update({"tokens_s": round(tokens[-1] / o["step_ms_median"] * 1000), "step_ms": [o["step_ms_median"], o["step_ms_p90"]]})
        losses = [r["loss"] for r in ours if "loss" in r]
        row["loss_first_last"] = [losses[0], losses[-1]] if losses else None
        record(out, row)


def report(out: Path) -> None:
    rows = read_jsonl(out / RESULTS)
    print("| DPO run | bare TRL tokens/s | swiftslurm tokens/s | ratio | peak MiB (bare / ours) |\n|---|---|---|---|---|")
    for r in (r for r in rows if r["what"] == "dpo"):
        print(f"| {r['run']} | {r.get('bare_tokens_s')} | {r.get('swiftslurm_tokens_s')} | {r.get('ratio')} | "
              f"{r.get('bare_peak_mb')} / {r.get('swiftslurm_peak_mb')} |")
    print("\n| full FT | optimizer | peak MiB | tokens/s | loss first -> last |\n|---|---|---|---|---|")
    for r in (r for r in rows if r["what"] == "galore"):
        fl = r.get("loss_first_last") or [None, None]
        print(f"| {r['shape']} | {r['optimizer']}{'' if r['rank'] is None else ' r' + str(r['rank'])} | {r.get('peak_mb')} | "
              f"{r.get('tokens_s')} | {fl[0]} -> {fl[1]} |")


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["dpo", "galore", "report", "all"])
    ap.add_argument("--work", default="/tmp/bench16")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench16-out"))
    ap.add_argument("--tiny", action="store_true", help="the tiny shape, short sequences (CPU smoke run of the driver)")
    ap.add_argument("--shapes", default="0.5b", help="galore shapes, e.g. 0.5b,1.5b")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rank", type=int, default=64)
    a = ap.parse_args()
    work, out = Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    seq = 64 if a.tiny else a.seq
    if a.part in ("dpo", "all"):
        dpo(work, out, "tiny" if a.tiny else "0.5b", a.steps, a.micro, seq)
    if a.part in ("galore", "all"):
        for shape in (["tiny"] if a.tiny else a.shapes.split(",")):
            galore(work, out, shape, a.steps, a.micro, seq, 8 if a.tiny else a.rank)
    if a.part in ("report", "all"):
        report(out)


if __name__ == "__main__":
    main()
