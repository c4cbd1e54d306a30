"""Coordination between the ranks of a preflight: a torch.distributed TCPStore with deadlines.

Rank 0 hosts the store on ``master_addr:<coord port>`` (a port next to MASTER_PORT, which the
trainer binds later). Every wait here has a deadline: a dead rank is named as missing, never waited
on forever. Values are JSON.

The store is one server for every rank, so each wait costs O(1) requests per poll, whatever the world
size: a barrier is one counter (``add``) that every rank polls, a gather one ``check`` of all pending keys
then one ``multi_get``; only at a deadline are keys checked one by one, to name who is missing. (A barrier
that polled every rank's key made O(world) requests per rank per poll: O(world^2) on the one server.)
Polls back off from ``POLL_MIN_S`` to ``POLL_S``, so hundreds of waiting ranks do not keep its CPU busy.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

POLL_S = 0.05
POLL_MIN_S = 0.002


def _polls():
    """Sleep lengths between polls: from POLL_MIN_S doubling up to POLL_S."""
    wait = POLL_MIN_S
    while True:
        yield wait
        wait = min(wait * 2, POLL_S)

# The preflight's own ports (store, test listener, iperf3 server) are MASTER_PORT+1..+3: a derived
# MASTER_PORT is the first port of the job's 4-port slot (slurm/distenv.py), below the Linux ephemeral
# range, so these are the rest of the slot and never another job's. The trainer binds MASTER_PORT later.
# (They once lived in 61000-65532 with 1511 slots: two jobs whose ids were equal mod 1511 collided.)


def preflight_ports(master_port: int) -> dict[str, int]:
    """The three ports of one job's preflight: MASTER_PORT+1..+3 (pure)."""
    return {"coord": master_port + 1, "test": master_port + 2, "iperf3": master_port + 3}


class CoordinationError(Exception):
    pass


class Coordinator:
    """Barriers, puts and gathers over a TCPStore, each bounded by a deadline."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size

    @classmethod
    def connect(cls, host: str, port: int, rank: int, world_size: int, timeout_s: float, prefix: str = "") -> "Coordinator":
        import torch.distributed as tdist

        try:
            store: tdist.Store = tdist.TCPStore(
                host, port, world_size, is_master=(rank == 0), timeout=timedelta(seconds=timeout_s), wait_for_workers=False
            )
        except Exception as exc:  # RuntimeError/DistNetworkError: name the address
            role = "host" if rank == 0 else "reach"
            raise CoordinationError(f"cannot {role} the preflight store at {host}:{port}: {exc}") from None
        if prefix:
            store = tdist.PrefixStore(prefix, store)
        return cls(store, rank, world_size)

    # ------------------------------------------------------------ key/value
    def put(self, key: str, value: Any) -> None:
        self.store.set(key, json.dumps(value))

    def _call(self, what: str, *args: Any) -> Any:
        try:
            return getattr(self.store, what)(*args)
        except Exception as exc:
            raise CoordinationError(f"lost the preflight store: {exc}") from None

    def _has(self, key: str) -> bool:
        return bool(self._call("check", [key]))

    def get(self, key: str, deadline: float) -> Any | None:
        """The value at key, or None when the deadline passes first."""
        polls = _polls()
        while not self._has(key):
            if time.monotonic() >= deadline:
                return None
            time.sleep(next(polls))
        return json.loads(self._call("get", key))

    def gather(self, prefix: str, ids: list[Any], deadline: float) -> tuple[dict[Any, Any], list[Any]]:
        """Values posted under ``prefix/<id>``: (found by id, missing ids) once all came or the deadline passed.
        One ``check`` of every key per poll; only at the deadline each key alone, to name the missing."""
        keys = {i: f"{prefix}/{i}" for i in ids}
        polls = _polls()
        while keys and not self._call("check", list(keys.values())):
            if time.monotonic() >= deadline:
                break
            time.sleep(next(polls))
        else:
            return self._fetch(keys), []
        present = {i: k for i, k in keys.items() if self._has(k)}
        return self._fetch(present), [i for i in ids if i not in present]

    def _fetch(self, keys: dict[Any, str]) -> dict[Any, Any]:
        if not keys:
            return {}
        values = self._call("multi_get", list(keys.values()))
        return {i: json.loads(v) for i, v in zip(keys, values, strict=True)}

    def barrier(self, name: str, deadline: float) -> list[int]:
        """Wait until every rank arrived at ``name``; returns the ranks still missing at the deadline.
        Every rank adds one to a counter and polls it (one request per poll); each also leaves its own key,
        read only when the deadline passes, to name the ranks that never came."""
        self.put(f"barrier/{name}/{self.rank}", 1)
        count = f"barrier/{name}/count"
        polls = _polls()
        arrived = self._call("add", count, 1)
        while arrived < self.world_size:
            if time.monotonic() >= deadline:
                return [r for r in range(self.world_size) if not self._has(f"barrier/{name}/{r}")]
            time.sleep(next(polls))
            arrived = self._call("add", count, 0)
        return []
