"""Where the package's data lives: the DeepSpeed presets (``ds_config/*.json``) and the sbatch
templates (``templates/*.j2``), wherever ``swiftslurm`` was imported from.

An installed wheel (or an editable install) carries them as the subpackages ``swiftslurm.ds_config``
and ``swiftslurm.templates``. A Python started inside a source checkout imports the checkout's
``swiftslurm/`` instead (the current directory comes first on ``sys.path``, so every rank of a job
submitted from the clone does this), and there the data are the top-level folders ``ds_config/`` and
``templates/`` next to it. ``resource_dir`` looks in that order: installed package data first, the
checkout's folders as the fallback.
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
    try:
        return resources.files(f"swiftslurm.{kind}")
    except ModuleNotFoundError:
        checkout = Path(__file__).resolve().parent.parent / kind
        if checkout.is_dir():
            return checkout
        raise FileNotFoundError(
            f"swiftslurm's {kind} folder is missing: neither the subpackage swiftslurm.{kind} nor {checkout} exists; "
            "reinstall swiftslurm (pip install .)"
        ) from None
