"""What a W&B offline run recorded, read from its ``run-<id>.wandb`` file (tests only).

wandb 0.31 has no Python reader of its own any more (``wandb.sdk.internal.datastore`` went with the move to
wandb-core), so this reads the file format directly: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then
LevelDB's log format (blocks of 32 KiB; each chunk a 7-byte header of CRC, little-endian length and type FULL /
FIRST / MIDDLE / LAST; a block tail under 7 bytes is padding), each record a ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterator

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: str | Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, f"{path}: not a W&B run file"
    pos, parts = HEADER, []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # padding up to the next block
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:  # a zeroed tail: the writer's preallocation
            pos += left
            continue
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, FIRST):
            parts = [chunk]
        else:
            parts.append(chunk)
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            yield record


def run_facts(path: str | Path) -> dict[str, Any]:
    """The run's id, name, group and project, and its history rows ``{step: {key: value}}`` (a step's rows merged)."""
    facts: dict[str, Any] = {"history": {}}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            facts.update(id=run.run_id, name=run.display_name, group=run.run_group, project=run.project)
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            step = int(row.pop("_step", record.history.step.num))
            facts["history"].setdefault(step, []).append(row)
    return facts
