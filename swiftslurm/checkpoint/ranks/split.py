"""The start-up verification split across ranks: each rank hashes a share of the files, one agreed verdict.

``newest_verified`` on rank 0 alone hashes the whole checkpoint: at 1 TB and 1-2 GB/s that is 10-30
minutes of every start, with every other rank waiting. Here, for each checkpoint newest to oldest:

1. rank 0 lists the output dir and checks the candidate without hashing (``verify.inspect``: manifest,
   step, missing, extra, sizes) and broadcasts what it found with the files to hash;
2. when rank 0 found nothing wrong, every rank checks it can read the checkpoint (``agree.readable_problem``)
   and hashes its share of the files (``shares``: balanced by bytes, largest first);
3. every rank's findings are all-gathered, so every rank draws the same verdict from the same list:
   verified (resume from it), damaged (a checksum mismatch or a read error: the next older one), or not
   visible from some rank although rank 0 saw it whole (``CheckpointUnreadable`` on every rank, naming the
   rank and node: a mount problem, not damage, so it must not silently resume from an older step).

The verified checkpoint is remembered (``cache``) so this job's first ``prune`` does not hash it again.
The transport is an ``agree.Exchange``; this module never imports torch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

from ..cache import remember_verified
from ..discover import list_checkpoints
from ..verify import hash_problems, inspect
from .agree import Exchange, readable_problem, undecided, unreadable_by


def shares(sizes: dict[str, int], world: int) -> list[list[str]]:
    """``sizes`` (file -> bytes) dealt to ``world`` ranks, each file to the rank with the fewest bytes so far,
    largest file first (ties by name, so every rank computes the same deal). Pure."""
    world = max(int(world), 1)
    load = [0] * world
    out: list[list[str]] = [[] for _ in range(world)]
    for rel in sorted(sizes, key=lambda r: (-int(sizes[r]), r)):
        least = min(range(world), key=lambda r: (load[r], r))
        out[least].append(rel)
        load[least] += int(sizes[rel])
    return [sorted(part) for part in out]


def _check_share(path: Path, rank: int, plan: dict[str, Any]) -> dict[str, Any]:
    """This rank's part of one candidate: can it read the checkpoint, and do its share's checksums match."""
    t0 = time.perf_counter()
    files = plan["files"]
    mine = shares({rel: int(e["size"]) for rel, e in files.items()}, plan["world"])[rank]
    unseen = (readable_problem(path, rank) or _share_unseen(path, mine, files)) if rank != 0 else None
    damage: list[str] = []
    if unseen is None and mine:
        try:
            damage = hash_problems(path, plan["algo"], {rel: files[rel] for rel in mine})
        except Exception as exc:  # noqa: BLE001 - one rank's surprise must not leave the others waiting
            damage = [f"rank {rank}: hashing its share failed: {type(exc).__name__}: {exc}"]
    return {"unseen": unseen, "damage": damage, "bytes": sum(int(files[r]["size"]) for r in mine),
            "seconds": time.perf_counter() - t0}


def _share_unseen(path: Path, mine: list[str], files: dict[str, Any]) -> str | None:
    """A file of this rank's share that rank 0 saw whole but this rank does not (missing, other size): a view
    problem of this node, not damage, so not a reason to fall back to an older checkpoint."""
    for rel in mine:
        try:
            size = os.stat(path / rel).st_size
        except FileNotFoundError:
            if not os.path.islink(path / rel):
                return f"{path.name}/{rel}: missing"
            continue  # a dangling symlink rank 0 would have seen too: hashing reports it
        except OSError:
            continue  # EIO, EACCES...: hashing names it as damage
        if size != int(files[rel]["size"]):
            return f"{path.name}/{rel}: size {size} bytes, manifest says {files[rel]['size']}"
    return None


def verified_split(
    output_dir: Path | str,
    rank: int,
    world: int,
    node: str,
    exchange: Exchange,
    log: Callable[[str], None] | None = print,
) -> Path | None:
    """The newest checkpoint under ``output_dir`` that verifies, with the hashing shared by ``world`` ranks;
    the same Path (or None) on every rank. Call it on every rank at once."""
    log = log if log is not None and rank == 0 else (lambda _msg: None)
    listing: dict[str, Any] = {"paths": [], "error": None}
    if rank == 0:
        try:
            listing["paths"] = [str(p) for p in list_checkpoints(output_dir)]
        except OSError as exc:
            listing["error"] = f"{output_dir}: {exc}"
    listing = exchange.broadcast(listing)
    if listing["error"]:
        raise undecided(listing["error"])
    for name in listing["paths"]:
        path = Path(name)
        plan: dict[str, Any] | None = None
        if rank == 0:
            try:
                manifest, problems, to_hash = inspect(path)
            except Exception as exc:  # noqa: BLE001 - the other ranks wait on this broadcast
                manifest, problems, to_hash = None, [f"unreadable: {exc}"], []
            plan = {"problems": problems, "world": world, "algo": manifest.algo if manifest else "",
                    "files": {rel: manifest.files[rel] for rel in to_hash} if manifest else {}}
        plan = exchange.broadcast(plan)
        if plan["problems"]:  # rank 0 saw damage without hashing: no rank hashes anything
            log(f"swiftslurm: skipping damaged {path.name}: {'; '.join(plan['problems'])}")
            continue
        mine = _check_share(path, rank, plan)
        verdicts = exchange.all_gather({"rank": rank, "node": node, **mine})
        unseen = [{**v, "problem": v["unseen"]} for v in verdicts if v["unseen"]]
        if unseen:
            raise unreadable_by(unseen, path)
        damage = [line for v in verdicts for line in v["damage"]]
        if damage:
            log(f"swiftslurm: skipping damaged {path.name}: {'; '.join(damage)}")
            continue
        remember_verified(path)
        slowest = max(verdicts, key=lambda v: v["seconds"])
        log(f"swiftslurm: {path.name} verified by {len(verdicts)} rank(s): {sum(v['bytes'] for v in verdicts) / 1e9:.2f} GB, "
            f"at most {max(v['bytes'] for v in verdicts) / 1e9:.2f} GB per rank, slowest rank {slowest['rank']} "
            f"{slowest['seconds']:.1f} s")
        return path
    return None
