"""Two-phase commit of a checkpoint directory.

All ranks write into ``<out>/.staging-checkpoint-<step>``; after a barrier one rank calls ``commit``:

1. hash every file (or take the hashes the ranks computed for their own shards) and fsync each file;
2. write ``manifest.json`` LAST: write to a temp name, fsync, rename, fsync the directory;
3. rename the staging directory to ``<out>/checkpoint-<step>`` and fsync ``<out>``;
4. replace ``<out>/latest`` atomically (temp file, fsync, rename, fsync ``<out>``).

A crash before step 3 leaves only a staging dir, which is never read as a checkpoint. A crash after
it leaves a complete, verifiable checkpoint. ``latest`` is a convenience: resume never trusts it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from ..fsutil import atomic_write_text, fsync_path, read_json
from .cache import remember_verified
from .manifest import MANIFEST_NAME, Manifest, algo_name, hash_files, library_versions, walk_files
from .names import DELETING_PREFIX, LATEST_NAME, owner_rank, staging_dir, step_of

# Test hooks: seconds to sleep between the steps of a commit, to widen the window a SIGKILL can hit; and "POINT:STEP",
# a SIGKILL of this process at that point of that step's save (``crash_point``: the commit's own points and the
# background save's, tests/test_fault_injection.py sweeps them)
DELAY_ENV = "SWIFTSLURM_CKPT_TEST_DELAY_S"
KILL_ENV = "SWIFTSLURM_CKPT_TEST_KILL_AT"


def prepare_staging(output_dir: Path | str, step: int) -> Path:
    """An empty staging dir for ``step``: leftovers of an earlier, killed attempt are removed first."""
    path = staging_dir(output_dir, step)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def _test_delay() -> None:
    delay = os.environ.get(DELAY_ENV)
    if delay:
        time.sleep(float(delay))


def crash_point(name: str, step: int | None) -> None:
    """The test hook's SIGKILL (``KILL_ENV``) when it names this point of this step's save; nothing otherwise."""
    if os.environ.get(KILL_ENV) == f"{name}:{step}":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def hash_own_files(staging: Path | str, rank: int, algo: str, workers: int = 4) -> dict[str, dict]:
    """What one rank contributes to ``commit(hashes=...)``: the hashes of the files it wrote itself
    (``names.owner_rank``), computed on that rank, in parallel with every other rank, before rank 0 commits."""
    staging = Path(staging)
    own = [rel for rel in walk_files(staging) if owner_rank(rel) == rank]
    return hash_files(staging, own, algo, workers=workers) if own else {}


# A background save's ranks hand rank 0 their shards' hashes as files in the staging dir (no collective: the training's
# process groups belong to the training thread); rank 0 reads them all, removes the folder, then commits.
RANK_HASHES_DIR = ".rank-hashes"


def publish_rank_hashes(staging: Path | str, rank: int, hashes: dict[str, dict]) -> None:
    """This rank's part of a background save is written and hashed: ``{rel: {size, checksum}}`` for rank 0."""
    folder = Path(staging) / RANK_HASHES_DIR
    folder.mkdir(exist_ok=True)
    atomic_write_text(folder / f"rank-{int(rank)}.json", json.dumps(hashes))


def collect_rank_hashes(staging: Path | str, world_size: int, timeout_s: float, poll_s: float = 0.05) -> dict[str, dict]:
    """Rank 0: wait until every other rank of ``world_size`` published its hashes (``TimeoutError`` after ``timeout_s``,
    naming the ranks missing), merge them, and remove the folder so the manifest does not list it. Rank 0's own files
    are hashed by ``commit``."""
    folder = Path(staging) / RANK_HASHES_DIR
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [r for r in range(1, world_size) if not (folder / f"rank-{r}.json").is_file()]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks {missing} did not finish writing their part of {Path(staging).name} within "
                               f"{timeout_s:g} s")
        time.sleep(poll_s)
    merged: dict[str, dict] = {}
    for r in range(1, world_size):
        merged.update(read_json(folder / f"rank-{r}.json", follow_symlinks=False))  # capped, a dict, no link followed
    shutil.rmtree(folder, ignore_errors=True)
    return merged


def commit(staging: Path | str, final: Path | str, *, algo: str, meta: dict, hashes: dict | None = None,
           timings: dict[str, float] | None = None) -> Manifest:
    """Seal ``staging`` as the checkpoint ``final``. Returns the Manifest written.

    ``hashes`` (``{rel: {size, checksum}}``, from ranks that hashed their own shards) is trusted for the
    files it names, after a size check; every other file in ``staging`` is hashed here.
    ``meta`` should carry step, world_size, seed and data_position; library versions are added.
    ``timings``, when given, receives the seconds of each phase: ``hash``, ``fsync``, ``commit`` (manifest,
    renames, ``latest``).
    """
    staging, final = Path(staging), Path(final)
    algo = algo_name(algo)
    timings = {} if timings is None else timings
    if not staging.is_dir():
        raise FileNotFoundError(f"staging directory {staging} does not exist")
    t0 = time.perf_counter()
    rels = [r for r in walk_files(staging) if r != MANIFEST_NAME]
    given = {r: v for r, v in (hashes or {}).items() if r in rels and (staging / r).stat().st_size == int(v["size"])}
    files = {**given, **hash_files(staging, [r for r in rels if r not in given], algo)}
    t1 = time.perf_counter()
    timings["hash"] = t1 - t0
    for rel in rels:
        fsync_path(staging / rel)
    for d in {(staging / r).parent for r in rels} | {staging}:
        fsync_path(d, directory=True)
    timings["fsync"] = time.perf_counter() - t1
    _test_delay()
    t2 = time.perf_counter()

    step = step_of(final)
    meta = dict(meta)
    step = int(meta.get("step", step if step is not None else -1))
    crash_point("fsynced", step)  # every file hashed and on disk, no manifest
    meta.setdefault("step", step)
    meta.setdefault("versions", dict(library_versions()))
    meta.setdefault("committed_at", time.time())
    manifest = Manifest(step=step, algo=algo, files=files, meta=meta)
    atomic_write_text(staging / MANIFEST_NAME, manifest.to_json())
    _test_delay()
    crash_point("manifest", step)  # the manifest written, still under the staging name

    if final.exists():  # a damaged or superseded copy of this step: move it aside, drop it after the swap
        aside = final.with_name(f"{DELETING_PREFIX}{final.name}.{os.getpid()}")
        os.rename(final, aside)
    else:
        aside = None
    os.rename(staging, final)
    fsync_path(final.parent, directory=True)
    _test_delay()
    crash_point("renamed", step)  # committed under its name, ``latest`` not yet moved
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    _point_latest(final)
    remember_verified(final)
    timings["commit"] = time.perf_counter() - t2
    return manifest


def _point_latest(final: Path) -> None:
    """Point ``<out>/latest`` at ``final`` unless a newer committed checkpoint exists."""
    out = final.parent
    step = step_of(final)
    newer = [p for p in out.iterdir() if p.is_dir() and (step_of(p) or -1) > (step if step is not None else -1)]
    if not newer:
        atomic_write_text(out / LATEST_NAME, final.name + "\n")
