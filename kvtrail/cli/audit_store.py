"""The audit commands' store option (``--db``) and the check that the file named is a store."""

from __future__ import annotations

import click

from kvtrail.errors import StoreError

DB_OPTION = click.option(
    "--db",
    "db",
    default="kvtrail.duckdb",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="DuckDB audit store file.",
)


def existing(db: str) -> str:
    from kvtrail.audit.storefile import require_file

    try:
        require_file(db)
    except StoreError as exc:
        raise StoreError(f"--db: {exc}") from None
    return db
