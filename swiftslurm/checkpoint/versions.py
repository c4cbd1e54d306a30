"""Manifest schema versions: which one a ``manifest.json`` was written in, and how an older one is read. Pure.

Every manifest version swiftslurm ever wrote must keep loading after an upgrade (``tests/data/checkpoints``
holds a golden checkpoint of each; ``tests/test_manifest_versions.py`` fails when ``MANIFEST_VERSION``
moves without one for the old version):

- **1** (the seed to 2026-12-01): ``"format": "swiftslurm-checkpoint/1"``, no ``version`` field. Its meta
  grew over time (``hashed_on_ranks``, then ``spec_fingerprint``, then ``data_position.packed_rows``); every
  meta key was always optional to readers, so one reader covers all of them.
- **2**: ``"format": "swiftslurm-checkpoint"`` and an integer ``"version": 2`` in the checksummed body.
  Meta may carry ``source`` (a checkpoint ``swiftslurm import`` brought in: its kind and path).

A manifest of a version newer than ``MANIFEST_VERSION`` is refused, naming both numbers: a newer
swiftslurm may have changed what a field means, and resuming from a misread checkpoint is worse than not.
"""

from __future__ import annotations

import re
from typing import Any

FORMAT_NAME = "swiftslurm-checkpoint"
MANIFEST_VERSION = 2  # what commit() writes; bump it only with a golden checkpoint of the old one in tests/data
_FORMAT_RE = re.compile(r"^swiftslurm-checkpoint(?:/(\d+))?$")


class UnsupportedVersion(ValueError):
    """A manifest this swiftslurm cannot read (not ours, or written by a newer swiftslurm); the message says which."""


def version_of(data: dict[str, Any]) -> int:
    """The schema version of a parsed manifest: its ``version`` field, else the ``/N`` of its format (1 when
    neither says, the seed's manifests). UnsupportedVersion for a foreign format or a newer version."""
    fmt = data.get("format")
    m = _FORMAT_RE.match(fmt) if isinstance(fmt, str) else None
    if m is None:
        raise UnsupportedVersion(f"not a swiftslurm manifest (format {fmt!r})")
    stated = data.get("version", int(m.group(1)) if m.group(1) else 1)
    if isinstance(stated, bool) or not isinstance(stated, int) or stated < 1:
        raise UnsupportedVersion(f"malformed: version {stated!r} is not a positive integer")
    if m.group(1) and int(m.group(1)) != stated:
        raise UnsupportedVersion(f"malformed: format {fmt!r} but version {stated}")
    if stated > MANIFEST_VERSION:
        raise UnsupportedVersion(
            f"manifest version {stated} was written by a newer swiftslurm; this one reads versions 1 to {MANIFEST_VERSION}: "
            "upgrade swiftslurm to use this checkpoint")
    return stated


def writer_fields() -> dict[str, Any]:
    """The version fields ``Manifest.body()`` writes (part of the checksummed body)."""
    return {"format": FORMAT_NAME, "version": MANIFEST_VERSION}


def upgrade(data: dict[str, Any], version: int) -> dict[str, Any]:
    """The manifest body in the current version's shape (a new dict; the on-disk file is never rewritten)."""
    out = dict(data)
    if version == 1:
        out["meta"] = dict(out.get("meta") or {})  # v1 meta: every key optional, the same names as v2
    out.update(writer_fields())
    return out
