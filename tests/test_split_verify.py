"""The start-up verification split across ranks: each rank hashes a share, one verdict on every rank.

Two real ranks (gloo, the trainer's own ``train.resume``) for the damaged file in the other rank's share;
an in-process exchange of threads (a real rendezvous, one thread per rank) for four ranks at once.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from test_checkpoint import make_checkpoint
from test_resume_agree import AGREE, free_port

from swiftslurm import checkpoint as ck
from swiftslurm.checkpoint import cache
from swiftslurm.checkpoint.ranks.split import shares
from swiftslurm.errors import CheckpointUnreadable


class ThreadExchange:
    """``checkpoint.Exchange`` among ``world`` threads: every call is a rendezvous of all of them."""

    def __init__(self, world: int):
        self.world = world
        self.slots: list[Any] = [None] * world
        self.barrier = threading.Barrier(world, timeout=60)

    def for_rank(self, rank: int) -> "ThreadExchange._Rank":
        return ThreadExchange._Rank(self, rank)

    class _Rank:
        def __init__(self, ex: "ThreadExchange", rank: int):
            self.ex, self.rank = ex, rank

        def all_gather(self, obj: Any) -> list[Any]:
            self.ex.slots[self.rank] = obj
            self.ex.barrier.wait()
            out = list(self.ex.slots)
            self.ex.barrier.wait()
            return out

        def broadcast(self, obj: Any) -> Any:
            return self.all_gather(obj)[0]


def run_world(world: int, fn) -> list[Any]:
    """``fn(rank, exchange)`` on ``world`` threads; each rank's result or exception, in rank order."""
    ex = ThreadExchange(world)
    out: list[Any] = [None] * world

    def one(rank: int) -> None:
        try:
            out[rank] = fn(rank, ex.for_rank(rank))
        except Exception as exc:  # noqa: BLE001 - compared by the test
            out[rank] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return out


def flip_byte(path: Path) -> None:
    """One byte changed in place: size, inode and mtime kept, so only hashing can tell."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def share_of(ckpt: Path, world: int) -> list[list[str]]:
    files = ck.read_manifest(ckpt).files
    return shares({rel: int(e["size"]) for rel, e in files.items()}, world)


@pytest.fixture
def three(tmp_path):
    out = tmp_path / "out"
    for step in (1, 2, 3):
        make_checkpoint(out, step)
    cache._fingerprints.clear()
    (out / cache.CACHE_FILE).unlink(missing_ok=True)
    return out


def test_shares_cover_every_file_once_balanced_by_bytes_and_the_same_on_every_rank():
    sizes = {"a": 100, "b": 90, "c": 50, "d": 40, "e": 10, "f": 10}
    parts = shares(sizes, 3)
    assert sorted(rel for part in parts for rel in part) == sorted(sizes)
    loads = [sum(sizes[r] for r in part) for part in parts]
    assert max(loads) - min(loads) <= 40 and max(loads) == 100, loads
    assert shares(dict(reversed(list(sizes.items()))), 3) == parts  # no dependence on dict order
    assert shares(sizes, 1) == [sorted(sizes)]
    assert shares({"a": 5}, 4) == [["a"], [], [], []]  # more ranks than files: the rest hash nothing


@pytest.mark.parametrize("owner", [0, 1, 2, 3])
def test_damage_in_any_ranks_share_is_found_and_every_rank_falls_back_alike(three, owner):
    newest = ck.final_dir(three, 3)
    victim = share_of(newest, 4)[owner][0]
    flip_byte(newest / victim)
    logs: list[str] = []
    got = run_world(4, lambda r, ex: ck.verified_split(three, r, 4, f"node{r}", ex, logs.append))
    assert got == [ck.final_dir(three, 2)] * 4, got
    assert any(f"skipping damaged checkpoint-3: {victim}: xxh3_128 checksum mismatch" in line for line in logs), logs
    assert len(logs) == 2, logs  # rank 0 alone speaks: the skip, then "checkpoint-2 verified by 4 rank(s)"
    assert "verified by 4 rank(s)" in logs[1]


def test_each_rank_hashes_only_its_share(three, monkeypatch):
    from swiftslurm.checkpoint.ranks import split

    hashed: dict[int, list[str]] = {}
    real = split.hash_problems

    def recording(path, algo, files, *a, **kw):
        hashed[int(threading.current_thread().name)] = sorted(files)
        return real(path, algo, files, *a, **kw)

    monkeypatch.setattr(split, "hash_problems", recording)
    ex = ThreadExchange(3)
    threads = [threading.Thread(name=str(r), target=ck.verified_split, args=(three, r, 3, "n", ex.for_rank(r), None)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert hashed == dict(enumerate(share_of(ck.final_dir(three, 3), 3))), hashed


def test_damage_rank_0_sees_by_stat_skips_without_hashing_and_no_candidate_is_a_fresh_start(three):
    for step in (1, 2, 3):
        (ck.final_dir(three, step) / "scheduler.pt").write_bytes(b"short")
    logs: list[str] = []
    got = run_world(2, lambda r, ex: ck.verified_split(three, r, 2, f"n{r}", ex, logs.append))
    assert got == [None, None], got
    assert len(logs) == 3 and all("size 5 bytes, manifest says 500" in line for line in logs), logs


def test_a_rank_that_cannot_see_a_file_rank_0_saw_stops_every_rank_instead_of_falling_back(three, monkeypatch):
    """A mount problem on one node is not damage: resuming from an older step would silently lose work."""
    from swiftslurm.checkpoint.ranks import split

    real = split.readable_problem
    monkeypatch.setattr(split, "readable_problem", lambda p, rank: "checkpoint-3/rng_state_1.pth: missing" if rank == 1 else real(p, rank))
    got = run_world(2, lambda r, ex: ck.verified_split(three, r, 2, f"node{r + 1}", ex, None))
    assert all(isinstance(g, CheckpointUnreadable) for g in got), got
    assert got[0].message() == got[1].message()
    assert got[0].message().startswith("rank 1 on node node2 cannot read the resume point checkpoint-3"), got[0].message()


def test_a_file_of_its_share_another_rank_cannot_see_is_a_view_problem_not_damage(three, monkeypatch):
    """Rank 1 does not see a file of its share (a stale node cache) that rank 0 saw: hashing it would call the
    checkpoint damaged and every rank would silently resume an older step."""
    import os as os_module

    from swiftslurm.checkpoint.names import owner_rank
    from swiftslurm.checkpoint.ranks import split

    newest = ck.final_dir(three, 3)
    hidden = newest / next(rel for rel in share_of(newest, 2)[1] if owner_rank(rel) == 0)  # not a file rank 1 loads
    assert ck.readable_problem(newest, 1) is None
    real_stat = os_module.stat

    def stat_as_rank_1_sees(p, *a, **kw):
        if Path(p) == hidden and threading.current_thread().name == "rank1":
            raise FileNotFoundError(2, "No such file or directory", str(p))
        return real_stat(p, *a, **kw)

    monkeypatch.setattr(split.os, "stat", stat_as_rank_1_sees)
    got: list = [None, None]
    ex = ThreadExchange(2)

    def rank(r: int) -> None:
        try:
            got[r] = ck.verified_split(three, r, 2, f"node{r + 1}", ex.for_rank(r), None)
        except CheckpointUnreadable as exc:
            got[r] = exc

    threads = [threading.Thread(target=rank, args=(r,), name=f"rank{r}") for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(g, CheckpointUnreadable) for g in got), got
    assert f"found: checkpoint-3/{hidden.relative_to(newest)}: missing" in got[0].message(), got[0].message()


def test_rank_0_failing_to_list_is_one_error_on_every_rank(three, monkeypatch):
    from swiftslurm.checkpoint.ranks import split

    def cannot_list(out):
        raise PermissionError(13, "Permission denied", str(out))

    monkeypatch.setattr(split, "list_checkpoints", cannot_list)
    got = run_world(2, lambda r, ex: ck.verified_split(three, r, 2, "n", ex, None))
    assert all(isinstance(g, CheckpointUnreadable) and "rank 0 could not choose" in g.message() for g in got), got
    assert "Permission denied" in got[1].message()


def test_the_checkpoint_resume_verified_is_not_hashed_again_by_this_jobs_prune(three):
    assert ck.verified_split(three, 0, 1, "n", ck.SingleRank(), None) == ck.final_dir(three, 3)
    flip_byte(ck.final_dir(three, 3) / "scheduler.pt")  # only a re-hash could notice
    removed = ck.prune(three, keep=1)
    assert [p.name for p in removed] == ["checkpoint-2", "checkpoint-1"]  # checkpoint-3 trusted: not hashed again
    cache._fingerprints.clear()
    (three / cache.CACHE_FILE).unlink()
    assert ck.newest_verified(three, log=None) is None  # resume itself always hashes


def test_two_real_ranks_find_damage_in_rank_1s_share(three):
    """The trainer's resume path (gloo process group): rank 0 never hashes rank 1's file, yet both ranks
    skip the damaged checkpoint and resume from the same older one."""
    import subprocess
    import sys

    newest = ck.final_dir(three, 3)
    victim = share_of(newest, 2)[1][0]
    flip_byte(newest / victim)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", AGREE, str(three), str(r)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**os.environ, "RANK": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for r in (0, 1)]
    texts = []
    for p in procs:
        try:
            texts.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            texts.append(p.communicate()[0])
    results = [next((ln for ln in t.splitlines() if ln.startswith(("RESULT", "ERROR"))), t[-2000:]) for t in texts]
    assert results == [f"RESULT {json.dumps({'path': str(ck.final_dir(three, 2))})}"] * 2, results
    assert f"skipping damaged checkpoint-3: {victim}: xxh3_128 checksum mismatch" in texts[0], texts[0]
    assert "checkpoint-2 verified by 2 rank(s)" in texts[0], texts[0]
