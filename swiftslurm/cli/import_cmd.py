"""`swiftslurm import PATH --into DIR [--json]`: a checkpoint we did not write, checked and committed under DIR."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from ..checkpoint.formats.importer import check_import, import_dir
from ..node.ownership import outside_writer, refuse_if_held


def import_command(console: Console, path: Path, into: Path, as_json: bool, checksum: str = "xxh3") -> int:
    refuse_if_held(into, "import")  # exit 3 when a live job owns DIR (or a dir above it): reads only
    check_import(path, into)  # then refusals about PATH and DIR's contents: DIR is not created or locked for nothing
    with outside_writer(into, "import"):  # held while it writes: no rank starts in DIR meanwhile
        facts, final = import_dir(path, into, checksum)
    if as_json:
        print(json.dumps({**facts.as_dict(), "checkpoint": str(final)}, indent=1))
        return 0
    stage = "-" if facts.zero_stage is None and not facts.deepspeed else (facts.zero_stage if facts.zero_stage is not None else "1 or 2")
    rows = [("kind", facts.kind + (" + DeepSpeed" if facts.deepspeed else "")), ("step", str(facts.step)),
            ("world size", str(facts.world_size or "-")), ("ZeRO stage", str(stage)), ("dtype", facts.dtype or "?"),
            ("weights", facts.weights or "-"), ("files", f"{facts.files} ({facts.bytes / 1e6:.1f} MB)")]
    console.print(f"imported [bold]{escape(str(path))}[/] as [bold]{escape(str(final))}[/] (verified)", highlight=False)
    for label, value in rows:
        console.print(f"  {label:<11} {escape(value)}", highlight=False)
    for note in facts.notes:
        console.print(f"  note: {escape(note)}", highlight=False)
    console.print(f"  resume from it: train.resume_from = \"{escape(str(final))}\" (or the original path)", highlight=False)
    return 0
