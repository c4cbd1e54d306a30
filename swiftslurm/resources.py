"""Where the package's data lives: the DeepSpeed presets (``ds_config/*.json``) and the sbatch
templates (``templates/*.j2``), wherever ``swiftslurm`` was imported from.

An installed wheel (or an editable install) carries them as the subpackages ``swiftslurm.ds_config``
and ``swiftslurm.templates``. A Python started inside a source checkout imports the checkout's
``swiftslurm/`` instead (the current directory comes first on ``sys.path``, so every rank of a job
submitted from the clone does this), and there the data are the top-level folders ``ds_config/`` and
``templates/`` next to it. ``resource_dir`` takes the checkout's folders when this ``swiftslurm/`` sits in
a source checkout (``setup.cfg`` beside it: an editable install elsewhere must not hand one checkout the
other's templates), else the installed package data.
"""

from __future__ import annotations

from importlib import resources
from importlib.abc import Traversable
from pathlib import Path

KINDS = ("ds_config", "templates")


def resource_dir(kind: str) -> Traversable:
    """The folder holding ``kind`` (``"ds_config"`` or ``"templates"``) of this swiftslurm."""
    if kind not in KINDS:
        raise ValueError(f"unknown resource kind {kind!r}; one of {KINDS}")
    root = Path(__file__).resolve().parent.parent
    if (root / "setup.cfg").is_file() and (root / kind).is_dir():
        return root / kind
    try:
        return resources.files(f"swiftslurm.{kind}")
    except ModuleNotFoundError:
        if (root / kind).is_dir():
            return root / kind
        raise FileNotFoundError(
            f"swiftslurm's {kind} folder is missing: neither the subpackage swiftslurm.{kind} nor {root / kind} exists; "
            "reinstall swiftslurm (pip install .)"
        ) from None
