"""DeepSpeed presets and rules (stub: the trainer work replaces this with the real module)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def preset_names() -> list[str]:
    root = resources.files("swiftslurm.ds_config")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def load_user_config(path: Path) -> dict:
    import json

    return json.loads(Path(path).read_text())


def build_for_spec(spec) -> tuple[dict, list[str]]:
    return {}, []
