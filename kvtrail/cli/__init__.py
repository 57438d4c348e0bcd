"""The ``kvtrail`` command: the only package that imports click (one module per command group)."""

from kvtrail.cli.root import cli, main

__all__ = ["cli", "main"]
