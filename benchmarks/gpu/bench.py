"""The GPU path, measured against bare baselines in the same run (issue 9). Run on the GPU machine:

    source benchmarks/gpu/setup.sh
    python3 benchmarks/gpu/bench.py all --work /tmp/bench --out $OUT        # everything
    python3 benchmarks/gpu/bench.py allreduce|train NAME|interrupt|report ...  # one part

Each swiftslurm figure comes from the user's path (`swiftslurm preflight` / `swiftslurm submit
--executor local --wait` with a spec); each baseline from a plain script under torchrun. Results go
to OUT/results.jsonl (one row per measurement); `report` prints the Markdown table of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RUNS = {  # name: (gpus, deepspeed preset, lora)
    "z2full2": (2, "zero2", False),
    "z3full2": (2, "zero3", False),
    "z2lora2": (2, "zero2", True),
    "z2full1": (1, "zero2", False),
}
GIB = 2**30


def sh(argv: list[str], log: Path, env: dict | None = None, timeout: float = 900) -> int:
    t0 = time.time()
    with open(log, "w") as fh:
        rc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
    print(f"  $ {' '.join(argv[:6])}{' ...' if len(argv) > 6 else ''} -> rc={rc} in {time.time() - t0:.0f} s (log {log.name})", flush=True)
    return rc


def record(out: Path, row: dict) -> None:
    with open(out / "results.jsonl", "a") as fh:
        fh.write(json.dumps(row) + "\n")
    print("  " + json.dumps(row), flush=True)


def spec_text(name: str, work: Path, gpus: int, ds: str, lora: bool, steps: int, checks: list[str] | None = None,
              save_steps: int = 1000, micro: int = 4, seq: int = 2048) -> str:
    assets = json.loads((work / "assets.json").read_text())
    targets = json.dumps(LORA_TARGETS) if lora else '"all-linear"'
    return f"""
[job]
name = "{name}"
output_dir = "{work / 'runs' / name}"
[slurm]
gpus_per_node = {gpus}
time = "01:00:00"
signal_grace_s = 60
[train]
model = "{assets['model_dir']}"
dataset = ["{assets['data']}"]
train_type = "{'lora' if lora else 'full'}"
deepspeed = "{ds}"
bf16 = true
gradient_checkpointing = false
per_device_train_batch_size = {micro}
learning_rate = 1e-4
lr_scheduler_type = "constant"
max_steps = {steps}
max_length = {seq}
save_steps = {save_steps}
logging_steps = 1
lora_rank = 16
lora_alpha = 32
lora_target_modules = {targets}
[checkpoint]
keep = 2
forced_save_fractions = []
[preflight]
checks = {json.dumps(checks or [])}
"""


def write_spec(work: Path, name: str, **kw) -> Path:
    path = work / "specs" / f"{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = spec_text(name, work, **kw)
    if os.environ.get("BENCH_CPU") == "1":  # a smoke run of this driver on a CPU machine
        text = text.replace("gpus_per_node =", "tasks_per_node =")
    path.write_text(text)
    return path


def step_stats(rows: list[dict], first: int = 6, last: int = 30) -> dict:
    """Step time from consecutive per-step log timestamps (the same method for both sides)."""
    rows = sorted((r for r in rows if "loss" in r), key=lambda r: r["step"])
    by_step = {r["step"]: r for r in rows}
    dts = [by_step[s]["time"] - by_step[s - 1]["time"] for s in range(first, last + 1) if s in by_step and s - 1 in by_step]
    if not dts:
        return {}
    dts.sort()
    p90 = dts[min(len(dts) - 1, int(round(0.9 * (len(dts) - 1))))]
    return {"step_ms_median": round(1000 * statistics.median(dts), 1), "step_ms_p90": round(1000 * p90, 1),
            "spread_ms": round(1000 * (p90 - statistics.median(dts)), 1), "n": len(dts)}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


# ---------------------------------------------------------------- parts

def assets(work: Path, out: Path, tiny: bool) -> None:
    work.mkdir(parents=True, exist_ok=True)
    if (work / "assets.json").exists():
        return
    argv = [sys.executable, str(HERE / "make_assets.py"), str(work)] + (["--tiny", "--samples", "64"] if tiny else [])
    res = subprocess.run(argv, capture_output=True, text=True, check=True)
    (work / "assets.json").write_text(res.stdout.strip().splitlines()[-1])
    print("  assets:", res.stdout.strip().splitlines()[-1], flush=True)


def allreduce(work: Path, out: Path) -> None:
    bare_json = work / "bare_allreduce.json"
    sh(["torchrun", "--standalone", "--nproc_per_node=2", str(HERE / "bare_allreduce.py"), str(bare_json)], out / "allreduce_bare.log")
    spec = write_spec(work, "preflight", gpus=2, ds="zero2", lora=False, steps=1, checks=["allreduce", "gpu"])
    shutil.rmtree(work / "runs" / "preflight", ignore_errors=True)
    rc = sh(["swiftslurm", "preflight", str(spec), "--executor", "local", "--json", str(work / "preflight.json")], out / "allreduce_swiftslurm.log")
    bare = json.loads(bare_json.read_text())
    report = json.loads((work / "runs" / "preflight" / "preflight" / "report.json").read_text())
    ours = report["busbw"]
    png = work / "runs" / "preflight" / "preflight" / "busbw.png"
    if png.exists():
        shutil.copy(png, out / "busbw.png")
    for size in (GIB, 4 * GIB):
        b = bare["busbw_gbps"][bare["sizes"].index(size)]
        o = ours["busbw_gbps"][ours["sizes"].index(size)]
        record(out, {"what": "allreduce_busbw_gbps", "size": size, "bare": b, "swiftslurm": o, "ratio": round(o / b, 3), "preflight_rc": rc})
    record(out, {"what": "allreduce_sweep", "sizes": ours["sizes"], "swiftslurm": ours["busbw_gbps"], "bare": bare["busbw_gbps"]})


def train(work: Path, out: Path, name: str, steps: int = 30) -> None:
    gpus, ds, lora = RUNS[name]
    spec = write_spec(work, name, gpus=gpus, ds=ds, lora=lora, steps=steps)
    run_dir = work / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    # the DeepSpeed dict swiftslurm merged for this spec: the bare script gets exactly the same one
    plan = json.loads(subprocess.run(["swiftslurm", "plan", str(spec), "--json"], capture_output=True, text=True, check=True).stdout)
    ds_json = work / f"{name}.ds.json"
    ds_json.write_text(json.dumps(plan["deepspeed"][0]))
    assets_ = json.loads((work / "assets.json").read_text())
    bare_dir = work / "bare" / name
    shutil.rmtree(bare_dir, ignore_errors=True)
    rc_b = sh(["torchrun", "--standalone", f"--nproc_per_node={gpus}", str(HERE / "bare_trainer.py"), "--model", assets_["model_dir"],
               "--data", assets_["data"], "--ds", str(ds_json), "--steps", str(steps), "--out", str(bare_dir)] + (["--lora"] if lora else []),
              out / f"{name}_bare.log")
    rc_s = sh(["swiftslurm", "submit", str(spec), "--executor", "local", "--wait"], out / f"{name}_swiftslurm.log")
    bare_rows = read_jsonl(bare_dir / "steps.jsonl")
    ours_rows = read_jsonl(run_dir / "metrics.jsonl")
    b, o = step_stats(bare_rows, last=steps), step_stats(ours_rows, last=steps)
    tokens_per_step = 4 * 2048 * gpus
    row = {"what": "train", "run": name, "gpus": gpus, "deepspeed": ds, "lora": lora, "rc_bare": rc_b, "rc_swiftslurm": rc_s}
    if b and o:
        row.update({
            "bare_tokens_s": round(tokens_per_step / b["step_ms_median"] * 1000), "swiftslurm_tokens_s": round(tokens_per_step / o["step_ms_median"] * 1000),
            "ratio": round(b["step_ms_median"] / o["step_ms_median"], 3),
            "bare_step_ms": [b["step_ms_median"], b["step_ms_p90"]], "swiftslurm_step_ms": [o["step_ms_median"], o["step_ms_p90"]],
            "bare_spread_ms": b["spread_ms"], "swiftslurm_spread_ms": o["spread_ms"],
        })
    peaks = [r["gpu_mem_peak_mb"] for r in ours_rows if "gpu_mem_peak_mb" in r]
    if peaks:
        row["swiftslurm_peak_mb"] = round(max(peaks))
    if (bare_dir / "summary.json").exists():
        row["bare_peak_mb"] = round(json.loads((bare_dir / "summary.json").read_text())["gpu_mem_peak_mb"])
    bl = {r["step"]: r["loss"] for r in bare_rows}
    ol = {r["step"]: r["loss"] for r in ours_rows if "loss" in r}
    common = sorted(set(bl) & set(ol))
    if common:
        row["max_abs_loss_diff_vs_bare"] = round(max(abs(bl[s] - ol[s]) for s in common), 6)
    comm = [r["comm_wait_ratio"] for r in ours_rows if "comm_wait_ratio" in r]
    if comm:
        row["comm_wait_ratio_median"] = round(statistics.median(comm), 4)
    record(out, row)
    for f in ("metrics.jsonl", "train-summary.json"):
        if (run_dir / f).exists():
            shutil.copy(run_dir / f, out / f"{name}_{f}")


def repeat(work: Path, out: Path, name: str, reps: int = 2, steps: int = 30) -> None:
    """Alternate bare / swiftslurm / swiftslurm without TensorBoard, `reps` times, to separate drift
    between runs from what swiftslurm adds (and what per-step TensorBoard writes cost)."""
    gpus, ds, lora = RUNS[name]
    assets_ = json.loads((work / "assets.json").read_text())
    spec = write_spec(work, name, gpus=gpus, ds=ds, lora=lora, steps=steps)
    spec_notb = work / "specs" / f"{name}_notb.toml"
    spec_notb.write_text(spec.read_text().replace(f"runs/{name}", f"runs/{name}_notb").replace("[checkpoint]", 'report_to = ["none"]\n[checkpoint]'))
    plan = json.loads(subprocess.run(["swiftslurm", "plan", str(spec), "--json"], capture_output=True, text=True, check=True).stdout)
    ds_json = work / f"{name}.ds.json"
    ds_json.write_text(json.dumps(plan["deepspeed"][0]))
    medians: dict[str, list[float]] = {"bare": [], "swiftslurm": [], "swiftslurm_no_tensorboard": []}
    spreads: dict[str, list[float]] = {k: [] for k in medians}
    for i in range(reps):
        bare_dir = work / "bare" / f"{name}_r{i}"
        shutil.rmtree(bare_dir, ignore_errors=True)
        sh(["torchrun", "--standalone", f"--nproc_per_node={gpus}", str(HERE / "bare_trainer.py"), "--model", assets_["model_dir"],
            "--data", assets_["data"], "--ds", str(ds_json), "--steps", str(steps), "--out", str(bare_dir)] + (["--lora"] if lora else []),
           out / f"{name}_r{i}_bare.log")
        runs = {"bare": read_jsonl(bare_dir / "steps.jsonl")}
        for key, sp, d in (("swiftslurm", spec, name), ("swiftslurm_no_tensorboard", spec_notb, f"{name}_notb")):
            shutil.rmtree(work / "runs" / d, ignore_errors=True)
            sh(["swiftslurm", "submit", str(sp), "--executor", "local", "--wait"], out / f"{name}_r{i}_{key}.log")
            runs[key] = read_jsonl(work / "runs" / d / "metrics.jsonl")
        for key, rows in runs.items():
            st = step_stats(rows, last=steps)
            if st:
                medians[key].append(st["step_ms_median"])
                spreads[key].append(st["spread_ms"])
    record(out, {"what": "repeat", "run": name, "step_ms_median": medians, "spread_ms": spreads,
                 "ratio_vs_bare": {k: round(statistics.median(medians["bare"]) / statistics.median(v), 3)
                                   for k, v in medians.items() if v and medians["bare"]}})


def _rank_pids() -> list[int]:
    """The local executor's rank processes (submitit runs each as `python -m submitit.core._submit`)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if b"submitit.core._submit" in (d / "cmdline").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def interrupt(work: Path, out: Path, steps: int = 40, at_step: int = 15) -> None:
    """USR2 mid-run -> verified save -> rerun of the same command resumes; losses vs an uninterrupted run."""
    gpus, ds, lora = RUNS["z2full2"]
    ref_dir = work / "runs" / "z2full2"  # the uninterrupted run, when `train z2full2` ran to `steps`
    if max((r.get("step", 0) for r in read_jsonl(ref_dir / "metrics.jsonl")), default=0) < steps:
        ref_dir = work / "runs" / "ref40"
        shutil.rmtree(ref_dir, ignore_errors=True)
        sh(["swiftslurm", "submit", str(write_spec(work, "ref40", gpus=gpus, ds=ds, lora=lora, steps=steps)), "--executor", "local", "--wait"],
           out / "ref40.log")
    spec = write_spec(work, "interrupted", gpus=gpus, ds=ds, lora=lora, steps=steps)
    shutil.rmtree(work / "runs" / "interrupted", ignore_errors=True)
    run_dir = work / "runs" / "interrupted"
    log = open(out / "interrupted_1.log", "w")
    proc = subprocess.Popen(["swiftslurm", "submit", str(spec), "--executor", "local", "--wait"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 400
    sent_at = None
    while time.time() < deadline and proc.poll() is None:
        rows = read_jsonl(run_dir / "metrics.jsonl")
        if rows and max(r.get("step", 0) for r in rows) >= at_step and sent_at is None:
            for pid in _rank_pids():
                os.kill(pid, signal.SIGUSR2)
            sent_at = max(r.get("step", 0) for r in rows)
        time.sleep(0.2)
    proc.wait(timeout=max(1, deadline - time.time()))
    log.close()
    ckpts = sorted(glob.glob(str(run_dir / "checkpoint-*")))
    verify = subprocess.run(["swiftslurm", "verify", str(run_dir)], capture_output=True, text=True)
    (out / "interrupted_verify.txt").write_text(verify.stdout + verify.stderr)
    sh(["swiftslurm", "submit", str(spec), "--executor", "local", "--wait"], out / "interrupted_2.log")
    ref = {r["step"]: r["loss"] for r in read_jsonl(ref_dir / "metrics.jsonl") if "loss" in r}
    got = {}
    for r in read_jsonl(run_dir / "metrics.jsonl"):
        if "loss" in r:
            got[r["step"]] = r["loss"]  # the rerun's rows come last and win for steps logged twice
    common = sorted(set(ref) & set(got))
    saves = [r["checkpoint_save_s"] for r in read_jsonl(run_dir / "metrics.jsonl") if "checkpoint_save_s" in r]
    size_gb = 0.0
    if ckpts:
        size_gb = sum(p.stat().st_size for p in Path(ckpts[0]).rglob("*") if p.is_file()) / 1e9
    record(out, {"what": "interrupt", "usr2_at_step": sent_at, "checkpoints_after_stop": [Path(c).name for c in ckpts],
                 "verify_rc": verify.returncode, "steps_compared": len(common),
                 "max_abs_loss_diff": round(max((abs(ref[s] - got[s]) for s in common), default=float("nan")), 6),
                 "bitwise_equal_steps": sum(1 for s in common if ref[s] == got[s]),
                 "save_s": saves, "checkpoint_gb": round(size_gb, 3),
                 "save_s_per_gb": round(saves[0] / size_gb, 2) if saves and size_gb else None})
    tensorboard(work, out, ref_dir)


def tensorboard(work: Path, out: Path, run_dir: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = {}
    for ev in glob.glob(str(run_dir / "runs" / "**" / "events.out.tfevents.*"), recursive=True):
        acc = EventAccumulator(ev)
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            vals = [e.value for e in acc.Scalars(tag)]
            found[tag] = [round(min(vals), 4), round(statistics.median(vals), 4), round(max(vals), 4)]
    keep = {k: v for k, v in found.items() if any(w in k for w in ("gpu_mem", "comm_wait", "tokens_per_s", "mfu", "loss", "data_wait"))}
    record(out, {"what": "tensorboard", "run": run_dir.name, "scalars_min_median_max": keep, "all_tags": sorted(found)})


def report(out: Path) -> None:
    rows = read_jsonl(out / "results.jsonl")
    print("| measurement | bare | swiftslurm | ratio |\n|---|---|---|---|")
    for r in rows:
        if r["what"] == "allreduce_busbw_gbps":
            print(f"| all-reduce busbw, 2 GPUs, {r['size'] // GIB} GiB (GB/s) | {r['bare']} | {r['swiftslurm']} | {r['ratio']} |")
        elif r["what"] == "train" and "ratio" in r:
            print(f"| {r['run']}: tokens/s (step ms median/p90) | {r['bare_tokens_s']} ({r['bare_step_ms'][0]}/{r['bare_step_ms'][1]}) | "
                  f"{r['swiftslurm_tokens_s']} ({r['swiftslurm_step_ms'][0]}/{r['swiftslurm_step_ms'][1]}) | {r['ratio']} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["assets", "allreduce", "train", "repeat", "interrupt", "report", "all"])
    ap.add_argument("names", nargs="*")
    ap.add_argument("--work", default="/tmp/bench")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench-out"))
    ap.add_argument("--tiny", action="store_true", help="a small model (CPU smoke run of the driver)")
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    work, out = Path(a.work), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.part in ("assets", "all") or not (work / "assets.json").exists():
        assets(work, out, a.tiny)
    if a.part in ("allreduce", "all"):
        allreduce(work, out)
    if a.part in ("train", "all"):
        for name in a.names or list(RUNS):
            # z2full2 runs 40 steps: it is also the uninterrupted reference of `interrupt`
            train(work, out, name, max(a.steps, 40) if name == "z2full2" else a.steps)
    if a.part == "repeat":
        for name in a.names or ["z2full1"]:
            repeat(work, out, name, steps=a.steps)
    if a.part in ("interrupt", "all"):
        interrupt(work, out)
    if a.part in ("report", "all"):
        report(out)


if __name__ == "__main__":
    main()
