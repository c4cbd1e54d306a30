"""The background save's two claims on a GPU (issue 54), in one process: a snapshot of CUDA tensors written later has
the bytes of a direct ``torch.save`` of the same state (device tags included), and what the copy costs the training
thread against the write it takes off it.

    source benchmarks/gpu/setup.sh
    python3 benchmarks/gpu/async_bytes.py --out $OUT [--gib 8] [--dir /tmp/ab]

State: a ZeRO-like optimizer shard of ``--gib`` GiB on cuda:0 (fp32 master weights and two moments, one flat tensor
each, plus a bf16 view-sharing dict). Rows go to OUT/results.jsonl: sha256 of both files and whether they are equal;
seconds of the direct save (write, fsync), of the snapshot (the training thread's part: a first one that allocates
the pinned buffers, then a second) and of its background write.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench import record  # noqa: E402


def sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/ab-out"))
    ap.add_argument("--dir", default="/tmp/ab")
    ap.add_argument("--gib", type=float, default=8.0)
    a = ap.parse_args()
    import torch

    from swiftslurm.train.save.snapshot import snapshot

    out, work = Path(a.out), Path(a.dir)
    out.mkdir(parents=True, exist_ok=True)
    (work / "sync").mkdir(parents=True, exist_ok=True)
    (work / "async").mkdir(parents=True, exist_ok=True)
    n = int(a.gib * 2**30 / 12)  # three fp32 tensors of n elements
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    master = torch.randn(n, device=dev)
    bf16 = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    state = {"optimizer_state_dict": {"fp32_flat_groups": [master], "state": {0: {"exp_avg": torch.randn(n, device=dev),
             "exp_avg_sq": torch.rand(n, device=dev), "step": torch.tensor(10.0, device=dev)}},
             "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999)}]},
             "module": {"w": bf16, "w_t": bf16.t(), "w_rows": bf16[:128]}, "ds_version": "x", "global_steps": 10}

    def timed(fn):
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        result = fn()
        if dev == "cuda":
            torch.cuda.synchronize()
        return result, time.perf_counter() - t

    def direct():
        torch.save(state, work / "sync" / "shard.pt")
        with open(work / "sync" / "shard.pt", "rb+") as f:
            os.fsync(f.fileno())

    _, direct_s = timed(direct)
    first, first_copy_s = timed(lambda: snapshot(state))
    first.release()
    del first
    snap, copy_s = timed(lambda: snapshot(state))
    master.add_(1.0)  # training goes on; the snapshot keeps the saved step
    def write():
        snap.save(str(work / "async" / "shard.pt"))
        with open(work / "async" / "shard.pt", "rb+") as f:
            os.fsync(f.fileno())

    _, write_s = timed(write)
    a_sha, b_sha = sha(work / "sync" / "shard.pt"), sha(work / "async" / "shard.pt")
    row = {"what": "async_bytes", "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "state_gib": round(snap.nbytes / 2**30, 2), "same_bytes": a_sha == b_sha, "sha256": [a_sha[:16], b_sha[:16]],
           "direct_save_s": round(direct_s, 2), "first_snapshot_s": round(first_copy_s, 2), "snapshot_s": round(copy_s, 2),
           "background_write_s": round(write_s, 2), "snapshot_vs_direct": round(copy_s / direct_s, 3)}
    record(out, row)
    for p in (work / "sync" / "shard.pt", work / "async" / "shard.pt"):
        p.unlink()


if __name__ == "__main__":
    main()
