"""Benchmark: verifying a checkpoint vs just reading the same bytes (same run, same code path minus the hash).

    .venv/bin/python benchmarks/verify.py [--gb 2] [--files 8] [--workers 4] [--repeats 3] [--dir /tmp]

Writes ``--gb`` GB of checkpoint-like files (``--files`` big shards plus a few small files) under
``--dir``, commits them with xxh3 (then again with md5), and times, interleaved per repeat:

- warm: the page cache holds every byte (one untimed read first, then each timed pass);
- cold: each pass after ``posix_fadvise(DONTNEED)`` on every file (clean pages leave the cache).

"read" is the same thread pool and chunked ``readinto`` loop as verify, without the hash. Reported:
median seconds, GB/s, and verify/read ratios (the goal for xxh3 is <= 1.25x the warm read time).
Everything it wrote is removed at the end.

Multi-process mode (``--procs 1,2,4``), as ranks do it: for each N, N processes each write ``--gb`` GB of
their own shards into one staging dir, meet at a barrier, and hash: first the files each wrote
(``hash_own_files``, the save), then, after the commit, each its share of the whole checkpoint
(``split.shares`` + ``verify.hash_problems``, the start-up check). Reported: the wall time of each hash
phase (barrier to last process done) for N x G GB against N=1 hashing G GB; goal <= 1.3x (hashing
scales with ranks, not with rank 0).

    .venv/bin/python benchmarks/verify.py --procs 1,2,4,8,16 --gb 1 --workers 1 [--cold]

``--workers`` is the hashing threads per process: 1 gives each rank one core, as on a node whose cores are
shared by its ranks; with more threads than cores, N processes compete for the cores one process used.
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


def _rank_proc(base: Path, rank: int, gb: float, files: int, barrier, results, cold: bool, workers: int) -> None:
    """One rank: write its shards, then (between barriers) hash its own files, then its verify share."""
    from swiftslurm.checkpoint.ranks.split import shares
    from swiftslurm.checkpoint.verify import hash_problems

    stage = ck.staging_dir(base, 1)
    block = os.urandom(16 << 20)
    per_file = int(gb * 1e9) // files
    (stage / "global_step1").mkdir(parents=True, exist_ok=True)
    for i in range(files):  # zero_pp_rank_<rank>_mp_rank_<i>: owned by this rank (names.owner_rank)
        with open(stage / "global_step1" / f"zero_pp_rank_{rank}_mp_rank_{i:02d}_optim_states.pt", "wb") as f:
            f.write(rank.to_bytes(8, "little") + i.to_bytes(8, "little"))
            left = per_file - 16
            while left > 0:
                f.write(block[: min(left, len(block))])
                left -= len(block)
    if cold:
        drop_cache(stage / "global_step1")
    barrier.wait()  # everything written
    t0 = time.perf_counter()
    own = ck.hash_own_files(stage, rank, "xxh3", workers=workers)
    results[f"save{rank}"] = (time.perf_counter() - t0, sum(v["size"] for v in own.values()))
    results[f"own{rank}"] = own
    barrier.wait()  # hashes done: the parent commits
    barrier.wait()  # committed: the start-up check
    final = ck.final_dir(base, 1)
    manifest = ck.read_manifest(final)
    world = int(manifest.meta["world"])
    mine = shares({rel: int(e["size"]) for rel, e in manifest.files.items()}, world)[rank]
    if cold:
        drop_cache(final / "global_step1")
    barrier.wait()
    t0 = time.perf_counter()
    problems = hash_problems(final, manifest.algo, {rel: manifest.files[rel] for rel in mine}, workers=workers)
    results[f"verify{rank}"] = (time.perf_counter() - t0, sum(int(manifest.files[r]["size"]) for r in mine), problems)
    barrier.wait()


def run_ranks(n: int, gb: float, files: int, workdir: str, cold: bool, workers: int) -> dict[str, float]:
    """N rank processes writing and hashing N x ``gb`` GB; wall seconds of each hash phase."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    base = Path(tempfile.mkdtemp(prefix="swiftslurm-verify-ranks-", dir=workdir))
    try:
        ck.prepare_staging(base, 1)
        barrier = ctx.Barrier(n + 1)
        with ctx.Manager() as manager:
            results = manager.dict()
            procs = [ctx.Process(target=_rank_proc, args=(base, r, gb, files, barrier, results, cold, workers)) for r in range(n)]
            for p in procs:
                p.start()
            barrier.wait()
            t0 = time.perf_counter()
            barrier.wait()
            save_wall = time.perf_counter() - t0
            hashes = {rel: v for r in range(n) for rel, v in results[f"own{r}"].items()}  # as the trainer gathers them
            manifest = ck.commit(ck.staging_dir(base, 1), ck.final_dir(base, 1), algo="xxh3", meta={"world": n}, hashes=hashes)
            barrier.wait()
            barrier.wait()
            t0 = time.perf_counter()
            barrier.wait()
            verify_wall = time.perf_counter() - t0
            for p in procs:
                p.join(60)
            problems = [line for r in range(n) for line in results[f"verify{r}"][2]]
            if problems:
                raise SystemExit(f"benchmark checkpoint did not verify: {problems}")
            return {"procs": n, "bytes": manifest.total_bytes, "save_hash_wall_s": save_wall, "verify_hash_wall_s": verify_wall,
                    "save_hash_max_rank_s": max(results[f"save{r}"][0] for r in range(n)),
                    "verify_hash_max_rank_s": max(results[f"verify{r}"][0] for r in range(n))}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main_ranks(args) -> int:
    counts = [int(x) for x in args.procs.split(",")]
    if 1 not in counts:
        counts = [1, *counts]
    rows = []
    for n in counts:  # the median of --repeats runs of each count, metric by metric
        runs = [run_ranks(n, args.gb, args.files_per_proc, args.dir, args.cold, args.workers) for _ in range(args.repeats)]
        rows.append({key: statistics.median(run[key] for run in runs) for key in runs[0]})
    base = rows[0]
    print(f"{args.gb} GB per process in {args.files_per_proc} shards, {args.workers} hashing thread(s) per process, cpus={os.cpu_count()}, "
          f"median of {args.repeats}, "
          f"{'cold' if args.cold else 'warm'} page cache; hash-phase wall time vs 1 process hashing {args.gb} GB")
    print(f"{'procs':>5}{'GB':>8}{'save hash s':>13}{'vs 1':>7}{'verify hash s':>15}{'vs 1':>7}")
    for row in rows:
        row["save_ratio"] = row["save_hash_wall_s"] / base["save_hash_wall_s"]
        row["verify_ratio"] = row["verify_hash_wall_s"] / base["verify_hash_wall_s"]
        print(f"{row['procs']:>5}{row['bytes'] / 1e9:>8.2f}{row['save_hash_wall_s']:>13.3f}{row['save_ratio']:>6.2f}x"
              f"{row['verify_hash_wall_s']:>15.3f}{row['verify_ratio']:>6.2f}x")
    worst = max(max(r["save_ratio"], r["verify_ratio"]) for r in rows)
    print(f"worst ratio {worst:.2f}x -> goal <= 1.3x {'met' if worst <= 1.3 else 'NOT met'}")
    print(json.dumps({"rows": rows}))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=2.0, help="checkpoint size in GB (1e9 bytes)")
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--workers", type=int, default=4, help="threads (verify's default is 4); per process with --procs")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-cache passes")
    ap.add_argument("--procs", help="multi-process mode: comma-separated process counts, e.g. 1,2,4 (--gb is per process)")
    ap.add_argument("--files-per-proc", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="multi-process mode: drop the page cache before each hash phase")
    args = ap.parse_args()
    if args.procs:
        return main_ranks(args)
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
