"""The command line: the typer app and every command's rich output.

The only layer that prints and picks exit codes; it may import every other part of swiftslurm,
and nothing imports it.
"""

from .app import app, main

__all__ = ["app", "main"]
