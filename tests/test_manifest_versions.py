"""Manifest schema versions: every version swiftslurm ever wrote loads and verifies (golden checkpoints in
tests/data/checkpoints, made by make_golden.py), a newer one is refused naming both numbers, and a bump of
MANIFEST_VERSION without a golden checkpoint of the old version fails here."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from swiftslurm import checkpoint as ck
from swiftslurm.checkpoint.manifest import body_checksum
from swiftslurm.checkpoint.versions import MANIFEST_VERSION

GOLDEN = Path(__file__).resolve().parent / "data" / "checkpoints"


def golden_dirs() -> list[Path]:
    """Every golden checkpoint (``v<N>[-era]/checkpoint-<step>``)."""
    return sorted(p for p in GOLDEN.glob("v*/checkpoint-*") if p.is_dir())


def version_in_name(ckpt: Path) -> int:
    return int(ckpt.parent.name[1:].split("-")[0])


def test_every_version_ever_written_has_a_golden_checkpoint():
    have = {version_in_name(p) for p in golden_dirs()}
    missing = sorted(set(range(1, MANIFEST_VERSION + 1)) - have)
    assert not missing, (f"no golden checkpoint of manifest version(s) {missing} in {GOLDEN}: before changing "
                         "MANIFEST_VERSION, keep one written by the old writer (tests/data/checkpoints/make_golden.py)")


@pytest.mark.parametrize("ckpt", golden_dirs(), ids=lambda p: p.parent.name)
def test_golden_checkpoint_loads_verifies_and_resumes(ckpt, tmp_path):
    result = ck.verify(ckpt)
    assert result.ok, result.problems
    m = result.manifest
    assert m.version == version_in_name(ckpt) and m.step == ck.step_of(ckpt)
    assert m.meta["world_size"] == 2 and m.meta["data_position"]["epoch"] > 0
    # a resume picks it (a copy: resume must not depend on where the golden file lives)
    out = tmp_path / "run"
    shutil.copytree(ckpt, out / ckpt.name)
    assert ck.newest_verified(out, log=None) == out / ckpt.name


def test_a_v1_checkpoint_without_fingerprint_resumes_with_a_warning(caplog):
    from swiftslurm.checkpoint.fingerprint import check_spec_drift

    ckpt = GOLDEN / "v1-seed" / "checkpoint-12"
    with caplog.at_level(logging.WARNING):
        check_spec_drift(ckpt, spec=None, ds_config=None, log=logging.getLogger("t"))
    assert "no spec fingerprint" in caplog.text


def test_the_writer_writes_the_current_version(tmp_path):
    stage = ck.prepare_staging(tmp_path, 3)
    (stage / "a.bin").write_bytes(b"x" * 10)
    ck.commit(stage, ck.final_dir(tmp_path, 3), algo="xxh3", meta={})
    raw = json.loads((tmp_path / "checkpoint-3" / "manifest.json").read_text())
    assert raw["version"] == MANIFEST_VERSION and raw["format"] == "swiftslurm-checkpoint"
    assert ck.read_manifest(tmp_path / "checkpoint-3").version == MANIFEST_VERSION


def rewrite(ckpt: Path, **fields) -> None:
    """Set manifest fields and re-seal the body checksum (as a future writer would)."""
    path = ckpt / "manifest.json"
    data = json.loads(path.read_text())
    data.pop("body_checksum")
    data.update(fields)
    path.write_text(json.dumps({**data, "body_checksum": body_checksum(data)}))


def test_a_newer_version_is_refused_naming_both_numbers(tmp_path):
    ckpt = tmp_path / "checkpoint-5"
    shutil.copytree(GOLDEN / f"v{MANIFEST_VERSION}" / "checkpoint-5", ckpt)
    newer = MANIFEST_VERSION + 1
    rewrite(ckpt, version=newer)
    result = ck.verify(ckpt)
    assert not result.ok
    assert f"manifest version {newer}" in result.summary() and f"versions 1 to {MANIFEST_VERSION}" in result.summary()
    proc = subprocess.run([sys.executable, "-m", "swiftslurm", "verify", str(ckpt)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": "250"})
    assert proc.returncode == 5, proc.stdout + proc.stderr
    out = " ".join((proc.stdout + proc.stderr).split())
    assert f"manifest version {newer}" in out and "upgrade swiftslurm" in out and "Traceback" not in out


@pytest.mark.parametrize("fields,why", [
    ({"format": "swiftslurm-checkpoint/1", "version": 2}, "format 'swiftslurm-checkpoint/1' but version 2"),
    ({"version": "2"}, "not a positive integer"),
    ({"version": 0}, "not a positive integer"),
    ({"format": "other-tool/3"}, "not a swiftslurm manifest"),
])
def test_malformed_version_fields_are_damage(tmp_path, fields, why):
    ckpt = tmp_path / "checkpoint-5"
    shutil.copytree(GOLDEN / f"v{MANIFEST_VERSION}" / "checkpoint-5", ckpt)
    rewrite(ckpt, **fields)
    result = ck.verify(ckpt)
    assert not result.ok and why in result.summary(), result.summary()
