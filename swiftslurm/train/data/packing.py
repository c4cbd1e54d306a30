"""Padding-free packing (``train.packing``): whole samples in rows of exactly ``max_length`` tokens.

The seam in the trainer is three names: ``PackedDataset`` (item i = the samples of row i, so
``per_device_train_batch_size`` counts rows and the Trainer's seeded sampler, its resume skip and
its epochs work on rows unchanged), ``PackingCollator`` (one batch of rows -> tensors) and
``prepare_model`` (no KV cache while training). Without packing the trainer uses ``data.Collator``.

A packed row, for samples A (3 tokens) and B (2 tokens) in a row of 8::

    input_ids     a0   a1   a2   b0   b1   pad  pad  pad
    position_ids   0    1    2    0    1    0    1    2
    labels      -100   a1   a2 -100   b1 -100 -100 -100

- No ``attention_mask`` in the batch: transformers (``masking_utils.find_packed_sequence_indices``)
  then reads the sample boundaries from ``position_ids`` (a position that is not the previous one + 1
  starts a new sequence) and builds a block-diagonal causal mask for sdpa, eager and flex_attention, so
  attention never crosses a sample. That detection is skipped when a KV cache exists, hence
  ``prepare_model``.
- The first token of every sample carries no label: the logit before it belongs to the previous
  sample, and predicting across a boundary would teach the model that samples follow each other.
  (Unpacked, that token is never a target either, so packed and unpacked losses are the same.)
- The padding at a row's end is a sequence of its own (positions restart at 0), without labels.
- ``varlen_attn`` (``varlen.py``) takes the boundaries with the batch (``boundaries=True``: the
  ``cu_seq_lens``/``max_length`` keys transformers' flash path reads), computed here on the CPU.
- flash_attention_2/3 detect packing from ``position_ids`` only when the batch holds ONE row
  (``modeling_flash_attention_utils._is_packed_sequence``): with a flash kernel the collator flattens
  the batch into one row of ``rows x max_length`` (``flatten=True``), which keeps the shape static.

Rows are filled best-fit decreasing (the longest sample first into the fullest row it still fits);
ties between samples of equal length are broken by a permutation drawn from the seed, so the rows
are a pure function of (lengths, max_length, seed): every rank and every requeue builds the same rows.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

from ..health.metrics import STATS_PREFIX
from ..kernels.varlen import boundaries as varlen_boundaries

IGNORE_INDEX = -100
REAL_TOKENS = STATS_PREFIX + "real_tokens"
SAMPLES = STATS_PREFIX + "samples"


class _FreeSpace:
    """Open rows by free space: the row with the least free space >= n, in O(log max_length)."""

    def __init__(self, capacity: int) -> None:
        self.size = 1 << max(1, capacity).bit_length()
        self.count = [0] * (2 * self.size)  # segment tree: open rows per free-space range
        self.rows: list[list[int]] = [[] for _ in range(self.size)]

    def _update(self, free: int, delta: int) -> None:
        i = free + self.size
        while i:
            self.count[i] += delta
            i //= 2

    def put(self, free: int, row: int) -> None:
        self.rows[free].append(row)
        self._update(free, +1)

    def take_fitting(self, need: int) -> tuple[int, int] | None:
        """(free, row) of the open row with the smallest free space >= need (removed), or None."""
        node, lo, hi = 1, 0, self.size - 1
        if not self._any(node, lo, hi, need):
            return None
        while lo != hi:  # descend: the left child when it has a fitting row, else the right one
            mid = (lo + hi) // 2
            if self._any(2 * node, lo, mid, need):
                node, hi = 2 * node, mid
            else:
                node, lo = 2 * node + 1, mid + 1
        row = self.rows[lo].pop()
        self._update(lo, -1)
        return lo, row

    def _any(self, node: int, lo: int, hi: int, need: int) -> bool:
        """Whether the subtree [lo, hi] holds an open row with free space >= need."""
        if hi < need or self.count[node] == 0:
            return False
        if lo >= need:
            return True
        mid = (lo + hi) // 2
        return self._any(2 * node, lo, mid, need) or self._any(2 * node + 1, mid + 1, hi, need)


def pack_rows(lengths: Sequence[int], max_length: int, seed: int) -> list[list[int]]:
    """Sample indices per row: every sample in exactly one row, no row over ``max_length`` tokens.

    Best-fit decreasing with seeded tie-breaks (see the module doc). A sample longer than
    ``max_length`` is a caller bug (the data is truncated when tokenized) and raises ValueError.
    """
    flat, bounds = pack_rows_flat(lengths, max_length, seed)
    return [flat[bounds[r]:bounds[r + 1]].tolist() for r in range(len(bounds) - 1)]


def pack_rows_flat(lengths: Sequence[int] | Any, max_length: int, seed: int):  # Any: a numpy array too
    """``pack_rows`` as two numpy arrays: the sample indices of every row back to back, and the row
    bounds (row r is ``flat[bounds[r]:bounds[r + 1]]``): 16 bytes per sample, not a list per row."""
    import numpy as np

    lens = np.asarray(lengths, dtype=np.int64).reshape(-1)
    n = len(lens)
    bad = np.flatnonzero((lens <= 0) | (lens > max_length))
    if len(bad):
        raise ValueError(f"sample {int(bad[0])} has {int(lens[bad[0]])} tokens; rows hold 1..{max_length}")
    tie = list(range(n))
    random.Random(seed).shuffle(tie)
    rank = np.empty(n, dtype=np.int64)
    rank[np.asarray(tie, dtype=np.int64)] = np.arange(n, dtype=np.int64)
    del tie
    order = np.lexsort((rank, -lens))  # longest first, ties by the seeded rank
    del rank
    row_of = np.empty(n, dtype=np.int64)  # the row of order[k]
    rows = 0
    free = _FreeSpace(max_length)
    for k, need in enumerate(lens[order].tolist()):
        found = free.take_fitting(need)
        if found is None:
            left, row = max_length, rows
            rows += 1
        else:
            left, row = found
        row_of[k] = row
        if left - need:
            free.put(left - need, row)
    by_row = np.argsort(row_of, kind="stable")  # within a row: the order samples were placed in
    flat = order[by_row]
    bounds = np.searchsorted(row_of[by_row], np.arange(rows + 1), side="left")
    return flat, bounds


class PackedDataset:
    """A map-style dataset of packed rows over a dataset of encoded samples (item = list of samples)."""

    def __init__(self, samples, max_length: int, seed: int) -> None:
        import numpy as np

        self.samples = samples
        self.max_length = max_length
        lengths = np.asarray(samples.lengths(), dtype=np.int64)
        self.flat, self.bounds = pack_rows_flat(lengths, max_length, seed)
        self.used = int(lengths.sum())

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def row(self, i: int) -> list[int]:
        """The sample indices of row i."""
        return self.flat[self.bounds[i]:self.bounds[i + 1]].tolist()

    def __getitem__(self, i: int) -> list[dict[str, list[int]]]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        return [self.samples[j] for j in self.row(i)]

    def padding_ratio(self) -> float:
        """Pad positions / all positions over every row (what the rows will cost before training)."""
        return 1.0 - self.used / (len(self) * self.max_length) if len(self) else 0.0


def pack_row(samples: list[dict[str, list[int]]], max_length: int, pad_id: int) -> dict[str, Any]:
    """One packed row (lists of exactly ``max_length``): see the module doc for the layout."""
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    for ex in samples:
        n = len(ex["input_ids"])
        ids += ex["input_ids"]
        labels += [IGNORE_INDEX] + list(ex["labels"][1:])
        positions += range(n)
    real = len(ids)
    if real > max_length:
        raise ValueError(f"a packed row holds {real} tokens, more than max_length={max_length}")
    pad = max_length - real
    return {"input_ids": ids + [pad_id] * pad, "labels": labels + [IGNORE_INDEX] * pad,
            "position_ids": positions + list(range(pad)), "real": real, "samples": len(samples)}


class PackingCollator:
    """A batch of packed rows -> ``input_ids``, ``labels``, ``position_ids`` (no ``attention_mask``), all
    ``[rows, max_length]`` (``[1, rows x max_length]`` with ``flatten``), plus per-row counts under
    ``STATS_PREFIX`` that the trainer takes out for its metrics before the forward pass."""

    def __init__(self, max_length: int, pad_id: int, flatten: bool = False, boundaries: bool = False) -> None:
        self.max_length = max_length
        self.pad_id = pad_id
        self.flatten = flatten
        self.boundaries = boundaries

    def __call__(self, batch: list[list[dict[str, list[int]]]]) -> dict[str, Any]:
        import torch

        rows = [pack_row(samples, self.max_length, self.pad_id) for samples in batch]
        out = {k: torch.tensor([r[k] for r in rows], dtype=torch.long) for k in ("input_ids", "labels", "position_ids")}
        if self.flatten:
            out = {k: v.reshape(1, -1) for k, v in out.items()}
        if self.boundaries:
            out.update(varlen_boundaries(out["position_ids"]))
        out[REAL_TOKENS] = torch.tensor([r["real"] for r in rows], dtype=torch.long)
        out[SAMPLES] = torch.tensor([r["samples"] for r in rows], dtype=torch.long)
        return out


def prepare_model(model) -> None:
    """No KV cache while training. With ``use_cache`` on (most configs' default) the model builds a
    DynamicCache even in a training forward, transformers then skips the packed-sequence detection,
    and every token attends to the whole row: samples would silently see each other. Every config in
    the module tree (a peft wrapper's base model included) is switched off."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "use_cache"):
            config.use_cache = False
