"""Coordination between the ranks of a preflight: a torch.distributed TCPStore with deadlines.

Rank 0 hosts the store on ``master_addr:<coord port>`` (a port next to MASTER_PORT, which the
trainer binds later). Every wait here has a deadline: a dead rank is named as missing, never waited
on forever. Values are JSON.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

POLL_S = 0.05

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
            store = tdist.TCPStore(
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

    def _has(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except Exception as exc:
            raise CoordinationError(f"lost the preflight store: {exc}") from None

    def get(self, key: str, deadline: float) -> Any | None:
        """The value at key, or None when the deadline passes first."""
        while not self._has(key):
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)
        return json.loads(self.store.get(key))

    def gather(self, prefix: str, ids: list[Any], deadline: float) -> tuple[dict[Any, Any], list[Any]]:
        """Values posted under ``prefix/<id>``: (found by id, missing ids) once all came or the deadline passed."""
        found: dict[Any, Any] = {}
        pending = list(ids)
        while True:
            for i in list(pending):
                if self._has(f"{prefix}/{i}"):
                    found[i] = json.loads(self.store.get(f"{prefix}/{i}"))
                    pending.remove(i)
            if not pending or time.monotonic() >= deadline:
                return found, pending
            time.sleep(POLL_S)

    def barrier(self, name: str, deadline: float) -> list[int]:
        """Wait until every rank arrived at ``name``; returns the ranks still missing at the deadline."""
        self.put(f"barrier/{name}/{self.rank}", 1)
        _, missing = self.gather(f"barrier/{name}", list(range(self.world_size)), deadline)
        return missing
