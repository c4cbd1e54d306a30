"""``<task dir>/chain.json``: the jobs of a singleton chain (``slurm.continue_with = "singleton"``: a walltime stop
continued as a new job, ``node/chain.py``), ``{"chains": [{"name": ..., "links": [job ids]}]}``; its read, its write
and the queries ``status`` and the requeue bound ask of it (pure over its contents).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..fsutil import RECORD_CAP, atomic_write_text, read_json
from ..taskdir import CHAIN_FILE


def read_chains(task_dir: str) -> list[list[str]]:
    """Each chain of this task dir as its job ids, oldest first; [] when none (missing or not ours)."""
    try:
        data = read_json(Path(task_dir, CHAIN_FILE), RECORD_CAP)
    except (OSError, ValueError):  # missing, or Unreadable: no chain
        return []
    chains = data.get("chains")
    out = []
    for chain in chains if isinstance(chains, list) else []:
        links = chain.get("links") if isinstance(chain, dict) else None
        if isinstance(links, list) and links and all(isinstance(j, str) and j for j in links):
            out.append(list(links))
    return out


def links_before(chains: list[list[str]], job_id: str) -> int:
    """How many jobs came before ``job_id`` in its chain (0: the first link, or in no chain)."""
    for links in chains:
        if job_id in links:
            return links.index(job_id)
    return 0


def newest(chains: list[list[str]], first: str) -> list[str]:
    """The links of the chain that began with job ``first`` (just ``[first]`` when it continued nowhere)."""
    for links in reversed(chains):  # the latest chain that began there (a reused job id: the newer one)
        if links[0] == first:
            return links
    return [first]


def with_link(chains: list[list[str]], after: str, new: str) -> list[list[str]]:
    """The chains with ``new`` appended to the one ending in ``after`` (a new chain ``[after, new]`` otherwise)."""
    out = [list(links) for links in chains]
    for links in out:
        if links[-1] == after:
            links.append(new)
            return out
    return out + [[after, new]]


def write_chains(task_dir: str, chains: list[list[str]], name: str) -> None:
    body = {"chains": [{"name": name, "links": links} for links in chains]}
    atomic_write_text(Path(task_dir, CHAIN_FILE), json.dumps(body, indent=2) + "\n")
