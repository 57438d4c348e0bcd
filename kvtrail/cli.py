"""The ``kvtrail`` command: one subcommand group per area (``kvtrail audit ...``) plus ``kvtrail demo``.

Bad input ends with one line on stderr and exit code 2; a failed check (e.g. a broken chain) with 1.
"""

from __future__ import annotations

import sys

import click
import duckdb

from kvtrail import __version__
from kvtrail.audit.cli import audit
from kvtrail.errors import KvtrailError


@click.group()
@click.version_option(__version__, prog_name="kvtrail")
def cli() -> None:
    """kvtrail: audit and forensics of KV-cache page ownership in LLM serving."""


cli.add_command(audit)


@cli.command()
@click.option("--db", default="kvtrail.duckdb", show_default=True, type=click.Path(dir_okay=False),
              help="DuckDB audit store to write (created if missing; a rerun appends).")
@click.option("--seed", default=0, show_default=True, help="Seed of the generated traffic.")
@click.option("--requests", default=60, show_default=True, type=click.IntRange(1), help="Requests per mode.")
def demo(db: str, seed: int, requests: int) -> None:
    """The main job: reproduce the incident on the reference PD stack, audit it, then run the fixed engine."""
    from kvtrail.demo import run_demo

    run_demo(db, seed=seed, requests=requests)


def main(argv: list[str] | None = None) -> int:
    try:
        cli.main(args=argv, prog_name="kvtrail", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.ClickException as exc:
        exc.show()
        return 2
    except click.Abort:
        click.echo("aborted", err=True)
        return 2
    except KvtrailError as exc:
        click.echo(f"error: {exc}", err=True)
        return 2
    except duckdb.IOException as exc:
        # Typically another process holds the store's write lock, or the path is unwritable.
        click.echo(f"error: cannot use the store: {str(exc).splitlines()[0]}", err=True)
        return 2
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
