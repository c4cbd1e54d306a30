"""Writes the golden checkpoints of each manifest version (run once per new version; never rewrite an old one).

    PYTHONPATH=. python tests/data/checkpoints/make_golden.py

``v1-*``: byte for byte what the version-1 writer (the seed's ``Manifest.to_json``, format
"swiftslurm-checkpoint/1", no version field) wrote, with the meta of two eras: the seed's trainer
(``v1-seed``) and the one with hashed_on_ranks, spec_fingerprint and packed rows (``v1-fingerprint``).
``v<N>`` for N >= 2: the current writer (``checkpoint.commit``), made when MANIFEST_VERSION became N.
The files are tiny stand-ins for an HF Trainer + DeepSpeed layout; only their bytes matter here.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import xxhash

HERE = Path(__file__).resolve().parent


def _files(ckpt: Path, step: int) -> None:
    g = ckpt / f"global_step{step}"
    g.mkdir(parents=True)
    (g / "mp_rank_00_model_states.pt").write_bytes(hashlib.sha256(b"model%d" % step).digest() * 8)
    for r in range(2):
        (g / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(hashlib.sha256(b"optim%d" % r).digest() * 4)
        (ckpt / f"rng_state_{r}.pth").write_bytes(hashlib.sha256(b"rng%d" % r).digest())
    (ckpt / "latest").write_text(f"global_step{step}")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))


def _v1(name: str, step: int, meta: dict) -> None:
    ckpt = HERE / name / f"checkpoint-{step}"
    if ckpt.exists():
        return
    _files(ckpt, step)
    files = {}
    for p in sorted(q for q in ckpt.rglob("*") if q.is_file()):
        data = p.read_bytes()
        files[p.relative_to(ckpt).as_posix()] = {"size": len(data), "checksum": xxhash.xxh3_128(data).hexdigest()}
    body = {"format": "swiftslurm-checkpoint/1", "algo": "xxh3_128", "step": step, "meta": meta, "files": files}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    text = json.dumps({**body, "body_checksum": hashlib.sha256(canonical.encode()).hexdigest()}, indent=1, sort_keys=True) + "\n"
    (ckpt / "manifest.json").write_text(text)


def main() -> int:
    versions = {"python": "3.11.9", "swiftslurm": "0.1.0", "torch": "2.5.1", "deepspeed": "0.16.2", "transformers": "4.47.0"}
    _v1("v1-seed", 12, {"step": 12, "world_size": 2, "seed": 42, "data_position": {"epoch": 0.5, "samples": 96},
                        "job_name": "quickstart", "train_type": "full", "versions": versions, "committed_at": 1764460000.0})
    _v1("v1-fingerprint", 8, {"step": 8, "world_size": 2, "seed": 42, "data_position": {"epoch": 0.25, "packed_rows": 64},
                              "job_name": "quickstart", "train_type": "full", "hashed_on_ranks": 2,
                              "spec_fingerprint": {"train.learning_rate": 0.003, "train.model": "tiny-llama"},
                              "versions": versions, "committed_at": 1764560000.0})
    from swiftslurm import checkpoint as ck
    from swiftslurm.checkpoint.versions import MANIFEST_VERSION

    out = HERE / f"v{MANIFEST_VERSION}"
    if not out.exists():
        step = 5
        stage = ck.prepare_staging(out, step)
        _files(stage, step)
        ck.commit(stage, ck.final_dir(out, step), algo="xxh3", meta={
            "world_size": 2, "seed": 42, "data_position": {"epoch": 0.1, "packed_rows": 40}, "job_name": "quickstart",
            "train_type": "full", "hashed_on_ranks": 2, "spec_fingerprint": {"train.model": "tiny-llama"},
            "versions": versions, "committed_at": 1764600000.0})
        (out / "latest").unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
