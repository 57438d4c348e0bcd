"""``kvtrail token add|list|revoke``: API tokens in a store (``--db``), in a token file (``--file``), or
through a running service (``--url``/``--token``, an operator token)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click
import duckdb

from kvtrail.answers import client as remote
from kvtrail.answers.tables import printable
from kvtrail.audit.store import AuditStore
from kvtrail.errors import KvtrailError, StoreError
from kvtrail.service import tokens
from kvtrail.timeutil import format_utc

URL = click.option("--url", envvar="KVTRAIL_URL", help="A running kvtrail service (env KVTRAIL_URL).")
TOKEN = click.option("--token", "api_token", envvar="KVTRAIL_TOKEN", help="An operator token (env KVTRAIL_TOKEN).")
DB = click.option("--db", type=click.Path(dir_okay=False), help="The store (not while a service holds it).")


@contextmanager
def _store(db: str) -> Iterator[duckdb.DuckDBPyConnection]:
    try:
        store = AuditStore(db)
    except StoreError as exc:
        if "in use by another process" in str(exc):
            raise KvtrailError(f"--db: store {db} is held by a running service (or another process); "
                               "manage tokens through it with --url URL --token OPERATOR_TOKEN") from None
        raise
    try:
        tokens.ensure_tables(store.con)
        yield store.con
    finally:
        store.close()


def _one_target(db: str | None, url: str | None, file: str | None = None) -> None:
    """Exactly one place the command works on."""
    given = [name for name, v in (("--db", db), ("--url", url), ("--file", file)) if v]
    if len(given) != 1:
        raise KvtrailError(f"{given[1] if len(given) > 1 else '--db'}: give exactly one of --db, --url"
                           + (" or --file" if file is not None else ""))


@click.group()
def token() -> None:
    """API tokens of the service: roles producer, operator and tenant:<id>; stored hashed."""


@token.command()
@DB
@URL
@TOKEN
@click.option("--file", type=click.Path(dir_okay=False),
              help="Append the token's line (id, role, hash; no secret) to this token file for "
                   "'kvtrail serve --tokens'.")
@click.option("--role", required=True, help="producer, operator or tenant:<id>.")
@click.option("--note", default="", help="What the token is for.")
@click.option("--node", "nodes", multiple=True, help="Producer tokens: a node it may send for (repeatable).")
def add(db, url, api_token, file, role, note, nodes) -> None:
    """Make a token and print it once, alone on the last line (only its hash is kept)."""
    _one_target(db, url, file)
    try:
        tokens.parse_role(role)
        if file:
            token_id, secret, stored = tokens.new_token(role, nodes=tuple(nodes))
            line = tokens.token_line(token_id, role, stored, nodes=tuple(sorted(set(nodes))), note=note)
            with Path(file).open("a", encoding="utf-8") as fh:
                fh.write(line + "\n")
        elif url:
            token_id, secret = remote.Client(url, api_token).add_token(role, note=note, nodes=tuple(nodes))
        else:
            with _store(db) as con:
                token_id, secret = tokens.add_token(con, role, note=note, nodes=tuple(nodes))
    except ValueError as exc:
        raise KvtrailError(f"--{str(exc).split(':', 1)[0]}: {str(exc).split(':', 1)[-1].strip()}") from None
    click.echo(printable(f"token {token_id} ({role}); shown once, keep it secret:"))
    click.echo(secret)


@token.command(name="list")
@DB
@URL
@TOKEN
def list_cmd(db, url, api_token) -> None:
    """Every token: id, role, nodes, created, revoked, note (never the secret or its hash)."""
    _one_target(db, url)
    if url:
        rows = remote.Client(url, api_token).list_tokens()
    else:
        with _store(db) as con:
            rows = [t.__dict__ for t in tokens.list_tokens(con)]
    for t in rows:
        state = f"revoked {format_utc(t['revoked_ns'])}" if t["revoked_ns"] is not None else "active"
        click.echo(printable(f"{t['token_id']}\t{t['role']}\t{','.join(t['nodes']) or '-'}\t"
                             f"created {format_utc(t['created_ns'])}\t{state}\t{t['note']}"))


@token.command()
@click.argument("token_id")
@DB
@URL
@TOKEN
def revoke(token_id, db, url, api_token) -> None:
    """Revoke a token by id: the service refuses it from its next request on."""
    _one_target(db, url)
    try:
        if url:
            changed = remote.Client(url, api_token).revoke_token(token_id)
        else:
            with _store(db) as con:
                changed = tokens.revoke_token(con, token_id)
    except ValueError as exc:
        raise KvtrailError(f"TOKEN_ID: {str(exc).split(':', 1)[-1].strip()}") from None
    click.echo(printable(f"revoked {token_id}" if changed else f"{token_id} was already revoked"))
