"""The preflight's coordination over a real TCPStore: barriers and gathers name who is missing, and each
wait costs the one store server O(1) requests per rank and poll, whatever the world size."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as tdist

from swiftslurm.preflight.coord import Coordinator  # noqa: E402


class Counting:
    """A store that counts the requests sent through it (the load on the one store server)."""

    def __init__(self, store):
        self.store, self.requests = store, 0

    def __getattr__(self, name):
        fn = getattr(self.store, name)

        def call(*args):
            self.requests += 1
            return fn(*args)

        return call


@pytest.fixture
def server():
    store = tdist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    yield store


def client(server, prefix="t"):
    return tdist.PrefixStore(prefix, tdist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timedelta(seconds=30),
                                                     wait_for_workers=False))


def test_a_barrier_names_the_rank_that_never_came_on_every_rank_that_did(server):
    out: dict[int, list[int]] = {}
    deadline = time.monotonic() + 1.5

    def rank(r: int) -> None:
        out[r] = Coordinator(client(server), r, 3).barrier("ready", deadline)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert out == {0: [2], 1: [2]}


def test_a_barrier_everyone_reaches_returns_at_once_and_can_be_reused_by_name(server):
    out: dict[int, list[int]] = {}

    def rank(r: int) -> None:
        coord = Coordinator(client(server), r, 4)
        out[r] = coord.barrier("a", time.monotonic() + 20) + coord.barrier("b", time.monotonic() + 20)

    t0 = time.monotonic()
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == {r: [] for r in range(4)} and time.monotonic() - t0 < 10


def test_gather_returns_what_came_and_names_what_did_not(server):
    coord = Coordinator(client(server), 0, 1)
    coord.put("results/node1", {"ok": 1})
    coord.put("results/node3", [3])
    found, missing = coord.gather("results", ["node1", "node2", "node3"], time.monotonic() + 0.3)
    assert found == {"node1": {"ok": 1}, "node3": [3]} and missing == ["node2"]
    coord.put("results/node2", "late")
    assert coord.gather("results", ["node1", "node2", "node3"], time.monotonic()) == (
        {"node1": {"ok": 1}, "node2": "late", "node3": [3]}, [])
    assert coord.gather("results", [], time.monotonic()) == ({}, [])


@pytest.mark.parametrize("world", [16, 256])
def test_waits_cost_the_store_a_constant_number_of_requests_whatever_the_world_size(server, world):
    """Every rank waiting polls the one store server: a barrier or a gather that read each rank's key made
    O(world) requests per rank per poll (O(world^2) on the server at 256 ranks)."""
    setup = Coordinator(client(server), 0, world)
    for r in range(1, world):
        setup.put(f"barrier/ready/{r}", 1)
        setup.put(f"views/{r}", r)
    setup.store.add("barrier/ready/count", world - 1)
    counting = Counting(client(server))
    coord = Coordinator(counting, 0, world)
    assert coord.barrier("ready", time.monotonic() + 10) == []
    assert counting.requests <= 3, counting.requests  # set own key, add, (nothing more: all had come)
    counting.requests = 0
    found, missing = coord.gather("views", list(range(1, world)), time.monotonic() + 10)
    assert len(found) == world - 1 and not missing
    assert counting.requests == 2, counting.requests  # one check of every key, one multi_get
