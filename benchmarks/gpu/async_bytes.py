"""The background save's two claims on a GPU (issue 54), in one process: a snapshot of CUDA tensors written later has
the bytes of a direct ``torch.save`` of the same state (device tags included), and what the copy costs the training
thread against the write it takes off it.

    source benchmarks/gpu/setup.sh
    python3 benchmarks/gpu/async_bytes.py --out $OUT [--gib 8] [--dir /tmp/ab]

Cases, each saved directly and through a snapshot, then compared byte for byte: ``scalar`` (a 0-dim CUDA tensor),
``views`` (a bf16 matrix with a transposed and a sliced view), ``cpu_mixed`` (a CUDA and a CPU tensor), ``small`` (the
shard below at 64 MiB) and ``shard``: a ZeRO-like optimizer shard of ``--gib`` GiB on cuda:0 (fp32 master weights and
two moments, one flat tensor each, plus the bf16 views). Where two files differ, the row says which zip records do
(name, sizes, first differing offset) and how the two ``data.pkl`` disassemblies differ. Rows go to OUT/results.jsonl,
with the seconds of the shard's direct save (write, fsync), of its snapshot (the training thread's part: a first one
into pageable memory, as a run's first save; the pinning of the pool's buffers after it, as the background writer
does; a second one into them), of a pinned allocation and a copy apart, and of the background write.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import io
import os
import pickletools
import sys
import time
import zipfile
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


def _record_sha(z: zipfile.ZipFile, name: str) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    with z.open(name) as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n


def _first_diff(a: bytes, b: bytes) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def zip_diff(a: Path, b: Path) -> dict:
    """Which records of two torch zip files differ, and how their pickles do."""
    za, zb = zipfile.ZipFile(a), zipfile.ZipFile(b)
    na, nb = za.namelist(), zb.namelist()
    out: dict = {"records_a": len(na), "records_b": len(nb), "only_a": sorted(set(na) - set(nb))[:20],
                 "only_b": sorted(set(nb) - set(na))[:20], "order_equal": na == nb, "differing": []}
    for name in (n for n in na if n in set(nb)):
        ia, ib = za.getinfo(name), zb.getinfo(name)
        (ha, sa), (hb, sb) = _record_sha(za, name), _record_sha(zb, name)
        if ha != hb or ia.header_offset != ib.header_offset or ia.extra != ib.extra:
            row = {"name": name, "size": [sa, sb], "content_equal": ha == hb, "offset": [ia.header_offset, ib.header_offset],
                   "extra_equal": ia.extra == ib.extra}
            if ha != hb and max(sa, sb) <= 1 << 26:
                row["first_diff"] = _first_diff(za.read(name), zb.read(name))
            out["differing"].append(row)
            if name.endswith("data.pkl") and ha != hb:
                dis = []
                for z in (za, zb):
                    buf = io.StringIO()
                    pickletools.dis(z.read(name), out=buf)
                    dis.append(buf.getvalue().splitlines())
                out["pickle_diff"] = list(difflib.unified_diff(dis[0], dis[1], "direct", "snapshot", n=1, lineterm=""))[:80]
    with open(a, "rb") as fa, open(b, "rb") as fb:
        ra, rb = fa.read(), fb.read()
    out["file_sizes"] = [len(ra), len(rb)]
    out["first_diff_offset"] = _first_diff(ra, rb)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/ab-out"))
    ap.add_argument("--dir", default="/tmp/ab")
    ap.add_argument("--gib", type=float, default=8.0)
    a = ap.parse_args()
    import torch
    import torch.serialization

    from swiftslurm.train.save.snapshot import prepare, snapshot

    out, work = Path(a.out), Path(a.dir)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    record(out, {"what": "async_bytes_env", "device": device, "torch": torch.__version__,
                 "package_registry": [(p, getattr(t, "__qualname__", str(t))) for p, t, _ in torch.serialization._package_registry]})

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    def timed(fn):
        sync()
        t = time.perf_counter()
        result = fn()
        sync()
        return result, time.perf_counter() - t

    def shard(gib: float) -> dict:
        n = int(gib * 2**30 / 12)  # three fp32 tensors of n elements
        bf16 = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
        return {"optimizer_state_dict": {"fp32_flat_groups": [torch.randn(n, device=dev)], "state": {0: {
                "exp_avg": torch.randn(n, device=dev), "exp_avg_sq": torch.rand(n, device=dev), "step": torch.tensor(10.0, device=dev)}},
                "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999)}]},
                "module": {"w": bf16, "w_t": bf16.t(), "w_rows": bf16[:128]}, "ds_version": "x", "global_steps": 10}

    m = torch.randn(64, 64, device=dev, dtype=torch.bfloat16)
    cases = {"scalar": lambda: {"step": torch.tensor(10.0, device=dev)},
             "views": lambda: {"w": m, "w_t": m.t(), "w_rows": m[:8]},
             "cpu_mixed": lambda: {"gpu": torch.arange(16.0, device=dev), "cpu": torch.arange(8)},
             "small": lambda: shard(1 / 16),
             "shard": lambda: shard(a.gib)}
    for name, make in cases.items():
        state = make()
        direct_p, snap_p = work / "direct" / "shard.pt", work / "snap" / "shard.pt"
        for p in (direct_p, snap_p):
            p.parent.mkdir(parents=True, exist_ok=True)

        def direct(state=state, p=direct_p):
            torch.save(state, p)
            with open(p, "rb+") as f:
                os.fsync(f.fileno())

        _, direct_s = timed(direct)
        first, first_copy_s = timed(lambda state=state: snapshot(state))  # a first save: pageable memory
        wanted = first.wanted
        first.release()
        del first
        prepare_s = prepare(wanted)  # what the background writer pins after the first save's commit
        snap, copy_s = timed(lambda state=state: snapshot(state))  # the next saves: the pool's pinned buffers
        nbytes = snap.nbytes
        for t in state.get("optimizer_state_dict", {}).get("fp32_flat_groups", []):
            t.add_(1.0)  # training goes on; the snapshot keeps the saved step

        def write(snap=snap, p=snap_p):
            snap.save(str(p))
            with open(p, "rb+") as f:
                os.fsync(f.fileno())

        _, write_s = timed(write)
        same = sha(direct_p) == sha(snap_p)
        row = {"what": "async_bytes", "case": name, "device": device, "state_gib": round(nbytes / 2**30, 3), "same_bytes": same,
               "direct_save_s": round(direct_s, 3), "first_snapshot_s": round(first_copy_s, 3), "prepare_s": round(prepare_s, 3),
               "snapshot_s": round(copy_s, 3), "pooled": not snap.wanted,
               "background_write_s": round(write_s, 3), "snapshot_vs_direct": round(copy_s / direct_s, 3) if direct_s else None}
        if not same:
            row["diff"] = zip_diff(direct_p, snap_p)
        if name == "shard" and dev == "cuda":  # where the snapshot's time goes: a pinned allocation, then the copy
            big = state["optimizer_state_dict"]["fp32_flat_groups"][0]
            host, row["pin_alloc_s"] = timed(lambda big=big: torch.empty(big.numel(), dtype=big.dtype, pin_memory=True))
            _, row["pinned_copy_s"] = timed(lambda host=host, big=big: host.copy_(big, non_blocking=True))
            _, row["pinned_copy_again_s"] = timed(lambda host=host, big=big: host.copy_(big, non_blocking=True))
            row["pinned_copy_gbps"] = round(big.numel() * 4 / row["pinned_copy_again_s"] / 1e9, 1)
            del host
        record(out, row)
        print(name, "same" if same else "DIFFERENT", flush=True)
        for p in (direct_p, snap_p):
            p.unlink()
        del state, snap
        if dev == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
