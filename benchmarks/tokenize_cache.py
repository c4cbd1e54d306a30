"""Tokenizing into the cache: one tokenizer call per record (``data.encode``, the old path) against one call per
chunk of 2048 records (``data.encode_many``, what ``datacache`` does now), same records, same tokenizer, same
process, each pass twice, alternating; the outputs are checked equal record by record.

    python benchmarks/tokenize_cache.py [--records 20000] [--vocab 32000] [--threads 2]

The tokenizer is a byte-level BPE fast tokenizer (the kind Qwen and Llama ship) trained here, in a few seconds,
on the synthetic records themselves (no download); ``--threads`` sets RAYON_NUM_THREADS (the Rust tokenizer's
pool for batches). Records: alpaca-like, lengths log-normal (median ~220 words, capped), as in
``benchmarks/data_rss.py``, plus one chat record in 8 (``messages``), so both kinds of call are batched. Tokens
counted: every token of the encoded examples (prompt + answer).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_rng = random.Random(1)
# 6000 pseudo-words with Zipf-like use: a BPE vocabulary of tens of thousands, as real ones have
WORDS = ["".join(_rng.choice("etaoinshrdlucmfwypvbgkjqxz"[: 8 + _rng.randrange(18)]) for _ in range(2 + _rng.randrange(9)))
         for _ in range(6000)]
WEIGHTS = [1 / (rank + 1) for rank in range(len(WORDS))]


def records(n: int, seed: int = 0) -> list[tuple[str, object]]:
    rng = random.Random(seed)

    def text(median: float) -> str:
        k = max(3, min(1500, int(rng.lognormvariate(0, 0.6) * median)))
        return " ".join(rng.choices(WORDS, WEIGHTS, k=k))

    out: list[tuple[str, object]] = []
    for i in range(n):
        if i % 8 == 7:
            out.append(("messages", [{"role": "user", "content": text(40)}, {"role": "assistant", "content": text(150)}]))
        else:
            out.append(("alpaca", {"instruction": text(30), "input": text(20) if i % 3 else "", "output": text(170)}))
    return out


def bpe_tokenizer(recs: list[tuple[str, object]], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from swiftslurm.train.tinymodel import CHAT_TEMPLATE

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def texts():
        for kind, rec in recs[:8000]:
            yield " ".join(m["content"] for m in rec) if kind == "messages" else " ".join(rec.values())

    tok.train_from_iterator(texts(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=20000)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    from swiftslurm.train.data import tokens as data
    from swiftslurm.train.data.cache import CHUNK

    recs = records(args.records)
    tok = bpe_tokenizer(recs, args.vocab)

    def one_by_one():
        return [data.encode(kind, rec, tok, args.max_length) for kind, rec in recs]

    def batched():
        out = []
        for i in range(0, len(recs), CHUNK):
            out += data.encode_many(recs[i:i + CHUNK], tok, args.max_length)
        return out

    times: dict[str, list[float]] = {"per record": [], "per chunk": []}
    results = {}
    for _ in range(2):
        for name, fn in (("per record", one_by_one), ("per chunk", batched)):
            t0 = time.perf_counter()
            results[name] = fn()
            times[name].append(time.perf_counter() - t0)
    assert results["per record"] == results["per chunk"], "batched encoding differs from one call per record"
    tokens = sum(len(ex["input_ids"]) for ex in results["per chunk"] if ex is not None)
    print(f"{len(recs)} records, {tokens} tokens (prompt + answer), byte-level BPE vocab {len(tok)}, "
          f"RAYON_NUM_THREADS={args.threads}, chunk {CHUNK}; outputs identical")
    base = min(times["per record"])
    for name, ts in times.items():
        best = min(ts)
        print(f"  {name:<11} {best:7.2f} s (runs: {', '.join(f'{t:.2f}' for t in ts)})  {len(recs) / best:9.0f} records/s "
              f"{tokens / best:11.0f} tokens/s  {base / best:5.2f}x")


if __name__ == "__main__":
    main()
