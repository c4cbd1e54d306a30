"""Benchmark: verifying a checkpoint vs just reading the same bytes (same run, same code path minus the hash).

    .venv/bin/python benchmarks/verify.py [--gb 2] [--files 8] [--workers 4] [--repeats 3] [--dir /tmp]

Writes ``--gb`` GB of checkpoint-like files (``--files`` big shards plus a few small files) under
``--dir``, commits them with xxh3 (then again with md5), and times, interleaved per repeat:

- warm: the page cache holds every byte (one untimed read first, then each timed pass);
- cold: each pass after ``posix_fadvise(DONTNEED)`` on every file (clean pages leave the cache).

"read" is the same thread pool and chunked ``readinto`` loop as verify, without the hash. Reported:
median seconds, GB/s, and verify/read ratios (the goal for xxh3 is <= 1.25x the warm read time).
Everything it wrote is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from swiftslurm import checkpoint as ck
from swiftslurm.checkpoint.manifest import CHUNK_BYTES, read_file, walk_files


def generate(stage: Path, total_bytes: int, n_files: int) -> None:
    block = os.urandom(64 << 20)
    shard = total_bytes // n_files
    (stage / "global_step1").mkdir(parents=True)
    for i in range(n_files):
        with open(stage / "global_step1" / f"zero_pp_rank_{i}_mp_rank_00_optim_states.pt", "wb") as f:
            left = shard
            f.write(i.to_bytes(8, "little"))
            left -= 8
            while left > 0:
                f.write(block[: min(left, len(block))])
                left -= len(block)
    for name, size in (("rng_state_0.pth", 15_000), ("scheduler.pt", 1_500), ("trainer_state.json", 800)):
        (stage / name).write_bytes(os.urandom(size))


def read_only(root: Path, workers: int) -> None:
    """What verify does, minus the hash: same pool, same chunked readinto."""
    rels = sorted(walk_files(root), key=lambda r: -(root / r).stat().st_size)
    local = threading.local()

    def one(rel: str) -> None:
        if not hasattr(local, "buf"):
            local.buf = bytearray(CHUNK_BYTES)
        read_file(root / rel, None, None, local.buf)

    with ThreadPoolExecutor(max_workers=min(workers, len(rels))) as pool:
        list(pool.map(one, rels))


def drop_cache(root: Path) -> None:
    for rel in walk_files(root):
        fd = os.open(root / rel, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def verify_ok(path: Path) -> None:
    result = ck.verify(path)
    if not result.ok:
        raise SystemExit(f"benchmark checkpoint did not verify: {result.problems}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0, help="checkpoint size in GB (1e9 bytes)")
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--workers", type=int, default=4, help="threads (verify's default is 4)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-cache passes")
    args = ap.parse_args()
    total = int(args.gb * 1e9)
    base = Path(tempfile.mkdtemp(prefix="swiftslurm-verify-bench-", dir=args.dir))
    try:
        t_gen = timed(lambda: generate(ck.prepare_staging(base, 1), total, args.files))
        ck1 = ck.final_dir(base, 1)
        t_commit_x = timed(lambda: ck.commit(ck.staging_dir(base, 1), ck1, algo="xxh3", meta={}))
        size = ck.read_manifest(ck1).total_bytes
        # the same bytes committed again with md5: checkpoint-2 hard-links checkpoint-1's files (one page cache)
        stage2 = ck.prepare_staging(base, 2)
        for rel in walk_files(ck1):
            if rel != ck.MANIFEST_NAME:
                (stage2 / rel).parent.mkdir(parents=True, exist_ok=True)
                os.link(ck1 / rel, stage2 / rel)
        ck2 = ck.final_dir(base, 2)
        t_commit_m = timed(lambda: ck.commit(stage2, ck2, algo="md5", meta={}))

        rows: dict[str, list[float]] = {"read warm": [], "xxh3 verify warm": [], "md5 verify warm": []}
        read_only(ck1, args.workers)  # warm the page cache (untimed)
        for _ in range(args.repeats):
            rows["read warm"].append(timed(lambda: read_only(ck1, args.workers)))
            rows["xxh3 verify warm"].append(timed(lambda: verify_ok(ck1)))
            rows["md5 verify warm"].append(timed(lambda: verify_ok(ck2)))
        if not args.no_cold:
            rows["read cold"], rows["xxh3 verify cold"] = [], []
            for _ in range(min(args.repeats, 2)):
                drop_cache(ck1)
                rows["read cold"].append(timed(lambda: read_only(ck1, args.workers)))
                drop_cache(ck1)
                rows["xxh3 verify cold"].append(timed(lambda: verify_ok(ck1)))

        med = {k: statistics.median(v) for k, v in rows.items()}
        print(f"checkpoint: {size / 1e9:.2f} GB in {args.files} shards + 3 small files under {base}")
        print(f"workers={args.workers} chunk={CHUNK_BYTES >> 10} KiB cpus={os.cpu_count()} repeats={args.repeats} (median)")
        print(f"generate {t_gen:.2f} s; commit with xxh3 (hash + fsync) {t_commit_x:.2f} s; commit with md5 {t_commit_m:.2f} s")
        print(f"{'pass':<20}{'seconds':>9}{'GB/s':>8}{'vs read':>9}")
        for key, secs in med.items():
            ref = med["read cold" if "cold" in key else "read warm"]
            print(f"{key:<20}{secs:>9.3f}{size / secs / 1e9:>8.2f}{secs / ref:>8.2f}x")
        ratio = med["xxh3 verify warm"] / med["read warm"]
        print(f"xxh3 verify / read (warm): {ratio:.2f}x -> goal <= 1.25x {'met' if ratio <= 1.25 else 'NOT met'}")
        print(f"md5 verify / read (warm): {med['md5 verify warm'] / med['read warm']:.2f}x")
        print(json.dumps({"bytes": size, "workers": args.workers, "median_s": med, "xxh3_ratio_warm": ratio}))
        return 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
