"""``LazyGroup``: a click group whose subcommands' modules are imported on first use.

``kvtrail --version`` and a typo then cost the interpreter, click and this package's root, not every
command group's imports (pandas, pyarrow, numba, DuckDB: seconds on a busy machine). Names, flags and
help text are those of the commands themselves: the group only postpones the import.
"""

from __future__ import annotations

import importlib

import click


class LazyGroup(click.Group):
    """A group that knows its subcommands as ``name -> "module:attribute"`` and imports one when asked."""

    def __init__(self, *args, lazy: dict[str, str] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy:
            module, _, attr = self.lazy[cmd_name].partition(":")
            cmd = getattr(importlib.import_module(module), attr)
            assert isinstance(cmd, click.Command), f"{self.lazy[cmd_name]} is not a click command"
            self.add_command(cmd, cmd_name)
        return self.commands.get(cmd_name)
