"""Sequence and tensor parallel training on CPU/gloo (issue 13): real DeepSpeed Ulysses SP and AutoTP
through the built-in trainer, 2 ranks, against the same samples on one rank (degree 1), fp32, 10 steps.

With SP or TP = 2 on 2 ranks the data-parallel size is 1, so the global batch is one rank's micro-batch,
exactly what the one-rank run trains on: the losses must agree step for step, on one machine and with one
rank on each of 2 Slurm nodes. The checkpoint records its degrees, and resuming it at another degree is
refused with the reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swiftslurm import checkpoint as ck
from swiftslurm.train.launch import launch

ROOT = Path(__file__).resolve().parents[1]
SPEC = """
[job]
output_dir = "{out}"
[slurm]
{slurm}
[train]
model = "tiny-llama"
dataset = ["{data}"]
train_type = "full"
deepspeed = "zero2"
gradient_checkpointing = false
packing = false
attn_implementation = "sdpa"
per_device_train_batch_size = 2
learning_rate = 3e-3
lr_scheduler_type = "constant"
max_steps = 10
max_length = 128
save_steps = 100
logging_steps = 1
report_to = ["none"]
[checkpoint]
forced_save_fractions = []
[preflight]
checks = []
[parallel]
{parallel}
"""


def spec(tmp: Path, name: str, ranks: int, parallel: str, slurm: str = "") -> tuple[str, Path]:
    out = tmp / name
    path = tmp / f"{name}.toml"
    path.write_text(SPEC.format(out=out, slurm=slurm or f"nodes = 1\ntasks_per_node = {ranks}",
                                data=ROOT / "examples/data/alpaca_demo.jsonl", parallel=parallel))
    return str(path), out


def train(tmp: Path, name: str, ranks: int, parallel: str, **kw) -> tuple[Path, list]:
    path, out = spec(tmp, name, ranks, parallel)
    return out, launch(path, str(out), nprocs=ranks, timeout_s=500, **kw)


def losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def expected(tmp_path_factory) -> list[float]:
    """The losses of one rank (degree 1) on the same samples."""
    base, procs = train(tmp_path_factory.mktemp("base"), "base", 1, "")
    assert procs[0].returncode == 0, procs[0].stdout[-4000:]
    found = losses(base)
    assert len(found) == 10 and found[-1] < found[0] - 1  # it learns
    return found


@pytest.mark.slow
def test_sp2_and_tp2_train_like_one_rank_and_resume_only_at_their_degree(tmp_path, expected):
    """The TP=2 run here also computes its MLPs tiled ([parallel] tiled_mlp: ceil(seq / hidden) = 2 slices of the
    65-128 token batches, tiny-llama's hidden size being 64, agreed over the ranks and recomputed in the backward while
    ZeRO holds each gradient until the last slice); TP=2 alone gives the one-rank losses across two Slurm nodes below."""
    import torch
    for name, parallel in (("sp2", "sequence_parallel = 2"), ("tp2", "tensor_parallel = 2\ntiled_mlp = true")):
        out, procs = train(tmp_path, name, 2, parallel)
        for rank, p in enumerate(procs):
            assert p.returncode == 0, f"{name} rank {rank}:\n{p.stdout[-4000:]}"
        assert losses(out) == pytest.approx(expected, abs=1e-4), name
        assert ("parallel.tiled_mlp: 2 MLPs compute in slices" in procs[0].stdout) == (name == "tp2")
        newest = ck.newest_verified(out)
        assert ck.read_manifest(newest).meta["parallel"] == {"sequence_parallel": 2 if name == "sp2" else 1,
                                                            "tensor_parallel": 2 if name == "tp2" else 1, "expert": 1}
    # AutoTP really split the layers: each TP rank holds half of q_proj's rows
    shard = torch.load(newest / "global_step10" / "mp_rank_01_model_states.pt", map_location="cpu", weights_only=False)
    assert tuple(shard["module"]["model.layers.0.self_attn.q_proj.weight"].shape) == (32, 64)
    # resuming the TP=2 checkpoint at TP=1 (same output dir): refused on every rank, before any step
    path, _ = spec(tmp_path, "tp2", 2, "")
    procs = launch(path, str(out), nprocs=2, resume="newest", timeout_s=300)
    for p in procs:
        assert p.returncode != 0 and "was saved at other parallel degrees" in p.stdout, p.stdout[-3000:]
        assert "tensor_parallel 2 -> 1" in p.stdout
    assert ck.newest_verified(out) == newest  # nothing new was written


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.parametrize("parallel", ["sequence_parallel = 2", "tensor_parallel = 2"])
def test_sp2_and_tp2_across_two_slurm_nodes(tmp_path, slurm_cluster, expected, parallel):
    """One rank on each of 2 Slurm nodes (gloo over 127.0.0.N), through `swiftslurm submit --wait`."""
    import subprocess
    import sys

    path, out = spec(tmp_path, "two-nodes", 2, parallel,
                     slurm='partition = "debug"\nnodes = 2\ntasks_per_node = 1\ntime = "00:10:00"\nsignal_grace_s = 60')
    proc = subprocess.run([sys.executable, "-m", "swiftslurm", "submit", path, "--executor", "slurm", "--wait"],
                          capture_output=True, text=True, timeout=500, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert losses(out) == pytest.approx(expected, abs=1e-4)


def test_a_tiled_mlp_gives_the_untiled_outputs_and_gradients_slice_by_slice(monkeypatch):
    """The patched MLP on one process: 150 tokens at hidden size 64 are 3 slices; outputs and every gradient match
    the plain MLP, and the slices really ran (one MLP call per slice, twice: forward, and again in the backward)."""
    import copy
    from types import SimpleNamespace

    import torch

    from swiftslurm.train import parallel
    from swiftslurm.train.tinymodel import build_model

    torch.manual_seed(0)
    plain = build_model(vocab_size=300, max_length=256, seed=0)
    tiled = copy.deepcopy(plain)
    spec = SimpleNamespace(parallel=SimpleNamespace(tiled_mlp=True))
    assert parallel.tile_mlps(spec, tiled) == 2
    calls = []
    real = parallel._mlp
    monkeypatch.setattr(parallel, "_mlp", lambda m, x: calls.append(x.shape[-2]) or real(m, x))
    ids = torch.randint(0, 300, (2, 150))
    outs = []
    for model in (plain, tiled):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        outs.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert calls[:3] == [50, 50, 50] and len(calls) == 2 * 2 * 3  # 2 MLPs x (forward + backward) x 3 slices
    assert torch.allclose(outs[0][0], outs[1][0], atol=1e-6)
    for name, grad in outs[0][1].items():
        assert torch.allclose(grad, outs[1][1][name], atol=1e-6), name
    with pytest.raises(parallel.ParallelError, match="no gated MLP"):
        parallel.tile_mlps(spec, torch.nn.Sequential(torch.nn.Linear(2, 2)))
