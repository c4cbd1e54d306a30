"""Peak memory of the data pipeline at scale: building the token cache, reading it from several ranks,
against the same examples held as Python lists (what the trainer did before the cache).

    python benchmarks/data_rss.py --records 1000000 --dir /tmp/data-rss [--ranks 2] [--num-proc 1]

Writes ``--records`` synthetic alpaca records (lengths log-normal, median ~220 tokens of the tiny
byte-level tokenizer, capped at 2048) to ``<dir>/alpaca.jsonl`` (kept: a second run reuses it), then
measures, each stage in a fresh process:

- scan: ``validate``'s record check over the file (records/s);
- builder: ``datacache.cached_dataset`` tokenizing into an empty cache;
- reader x ranks: ranks that open the cache at once, pack its rows (``train.packing``) and read every
  row once (as the DataLoader does over an epoch);
- lists: the same examples as the Python lists of ``data.SFTDataset`` (read from the cache, so
  nothing is tokenized twice).

Peak RSS is ``ru_maxrss``; it counts the cache's pages a process touched, which are page cache
(shared by the ranks of a node and dropped under pressure), so the private memory at the end
(``RssAnon`` of /proc/self/status) is printed beside it. ``base`` is a process that only imports the
same modules and builds the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORDS = ("the model data train token batch rank cache memory sample answer question explain describe "
         "list write short long node cluster step loss rate value file line").split()


def write_records(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as fh:
        for i in range(n):
            total = min(2048, int(rng.lognormvariate(5.4, 0.6)))  # bytes = tokens of the byte-level tokenizer
            words = [rng.choice(WORDS) for _ in range(max(6, total // 6))]
            cut = max(2, len(words) // 3)
            rec = {"instruction": " ".join(words[:cut]), "output": " ".join(words[cut:])}
            if i % 3 == 0:
                rec["input"] = f"item {i}"
            fh.write(json.dumps(rec) + "\n")


def _memory() -> dict[str, float]:
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    anon = int(status.get("RssAnon", "0 kB").split()[0]) / 1024
    return {"peak_rss_mb": round(peak_mb, 1), "anon_rss_mb_at_end": round(anon, 1)}


def _imports():
    import numpy  # noqa: F401

    from swiftslurm.train.data import cache as datacache
    from swiftslurm.train.data import packing
    from swiftslurm.train.data import tokens as data
    from swiftslurm.train.tinymodel import build_tokenizer

    return data, datacache, packing, build_tokenizer


def stage_base(a, q) -> None:
    _imports()[3]()  # the tokenizer too (transformers)
    q.put(("base", _memory()))


def stage_scan(a, q) -> None:
    data, *_ = _imports()
    start = time.monotonic()
    count = data.scan([a.file])
    wall = time.monotonic() - start
    q.put(("scan", {"records": count, "seconds": round(wall, 1), "records_per_s": round(count / wall), **_memory()}))


def stage_build(a, q) -> None:
    _, datacache, _, build_tokenizer = _imports()
    start = time.monotonic()
    ds = datacache.cached_dataset([a.file], build_tokenizer(), 2048, a.cache, a.num_proc)
    wall = time.monotonic() - start
    size = sum(f.stat().st_size for f in ds.directory.iterdir())
    q.put(("builder", {"examples": len(ds), "tokenized_now": ds.tokenized_now, "seconds": round(wall, 1),
                       "records_per_s": round(len(ds) / wall), "cache_mb": round(size / 2**20, 1), **_memory()}))


def stage_read(a, q, rank: int) -> None:
    _, datacache, packing, build_tokenizer = _imports()
    ds = datacache.cached_dataset([a.file], build_tokenizer(), 2048, a.cache)
    rows = packing.PackedDataset(ds, 2048, seed=0)
    tokens = 0
    for i in range(len(rows)):
        tokens += sum(len(ex["input_ids"]) for ex in rows[i])
    q.put((f"reader rank {rank}", {"rows": len(rows), "tokens_read": tokens, "tokenized_now": ds.tokenized_now,
                                   **_memory()}))


def stage_lists(a, q) -> None:
    data, datacache, _, build_tokenizer = _imports()
    cached = datacache.cached_dataset([a.file], build_tokenizer(), 2048, a.cache)
    held = data.SFTDataset([cached[i] for i in range(len(cached))])
    q.put(("python lists", {"examples": len(held), **_memory()}))


def run(stages, a) -> list[tuple[str, dict]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(a, q, *extra)) for fn, *extra in stages]
    for p in procs:
        p.start()
    out = [q.get() for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"a stage failed (exit {p.exitcode})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--dir", type=Path, required=True, help="where the data file and the cache go")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--num-proc", type=int, default=1, help="tokenizing processes of the builder")
    a = ap.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    path = a.dir / f"alpaca-{a.records}.jsonl"
    if not path.exists():
        write_records(path, a.records)
    a.file, a.cache = str(path), str(a.dir / f"cache-{a.records}")
    results = run([(stage_base,)], a) + run([(stage_scan,)], a) + run([(stage_build,)], a)
    results += run([(stage_read, r) for r in range(a.ranks)], a) + run([(stage_lists,)], a)
    print(f"{a.records:,} records, {path.stat().st_size / 2**20:.0f} MiB JSONL")
    for name, figures in results:
        print(f"{name:>15}: " + ", ".join(f"{k} {v}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
