"""``kvtrail token add|list|revoke``: API tokens in a store (``--db``), in a token file (``--file``), or
through a running service (``--url``/``--token``, an operator token)."""

from __future__ import annotations

import time
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
            raise KvtrailError(
                f"--db: store {db} is held by a running service (or another process); "
                "manage tokens through it with --url URL --token OPERATOR_TOKEN"
            ) from None
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
        raise KvtrailError(
            f"{given[1] if len(given) > 1 else '--db'}: give exactly one of --db, --url"
            + (" or --file" if file is not None else "")
        )


@click.group()
def token() -> None:
    """API tokens of the service: roles producer, operator, metrics and tenant:<id>; stored hashed."""


@token.command()
@DB
@URL
@TOKEN
@click.option(
    "--file",
    type=click.Path(dir_okay=False),
    help="Append the token's line (id, role, hash; no secret) to this token file for 'kvtrail serve --tokens'.",
)
@click.option("--role", required=True, help="producer, operator, metrics (GET /metrics only) or tenant:<id>.")
@click.option("--note", default="", help="What the token is for.")
@click.option("--node", "nodes", multiple=True, help="Producer tokens: a node it may send for (repeatable).")
@click.option(
    "--cluster", "clusters", multiple=True, help="Producer tokens: a cluster it may send for (repeatable; default any)."
)
@click.option(
    "--node-role",
    "node_roles",
    multiple=True,
    help="Producer tokens: a node role it may send for: prefill, decode, unified, router (repeatable).",
)
@click.option(
    "--expires-in",
    "expires_in",
    metavar="DURATION",
    help="The token stops working after this long: 30m, 12h, 90d, 2w (default: until revoked).",
)
def add(db, url, api_token, file, role, note, nodes, clusters, node_roles, expires_in) -> None:
    """Make a token and print it once, alone on the last line (only its hash is kept)."""
    _one_target(db, url, file)
    try:
        tokens.parse_role(role)
        lifetime_ns = tokens.parse_duration(expires_in) if expires_in is not None else None
        binding = tokens.Binding(
            tuple(nodes),
            tuple(clusters),
            tuple(node_roles),
            None if lifetime_ns is None else time.time_ns() + lifetime_ns,
        ).checked(role)
        if file:
            token_id, secret, stored = tokens.new_token(role, binding=binding)
            line = tokens.token_line(token_id, role, stored, note=note, binding=binding)
            with Path(file).open("a", encoding="utf-8") as fh:
                fh.write(line + "\n")
        elif url:
            token_id, secret = remote.Client(url, api_token).add_token(
                role,
                note=note,
                nodes=binding.nodes,
                clusters=binding.clusters,
                node_roles=binding.node_roles,
                expires_in_s=None if lifetime_ns is None else lifetime_ns // 10**9,
            )
        else:
            with _store(db) as con:
                token_id, secret = tokens.add_token(con, role, note=note, binding=binding)
    except ValueError as exc:
        raise KvtrailError(f"--{str(exc).split(':', 1)[0]}: {str(exc).split(':', 1)[-1].strip()}") from None
    click.echo(printable(f"token {token_id} ({role}); shown once, keep it secret:"))
    click.echo(secret)


@token.command(name="list")
@DB
@URL
@TOKEN
def list_cmd(db, url, api_token) -> None:
    """Every token, one line each, fields separated by tabs: id, role, what a producer token may send for
    (nodes, then cluster= and role= bindings; - for any), created, state (active, expires, expired,
    revoked), note (never the secret or its hash)."""
    _one_target(db, url)
    if url:
        rows = remote.Client(url, api_token).list_tokens()
    else:
        with _store(db) as con:
            rows = [t.__dict__ for t in tokens.list_tokens(con)]
    now = time.time_ns()
    for t in rows:
        expires = t.get("expires_ns")
        if t["revoked_ns"] is not None:
            state = f"revoked {format_utc(t['revoked_ns'])}"
        elif expires is not None:
            state = f"{'expired' if expires <= now else 'active, expires'} {format_utc(expires)}"
        else:
            state = "active"
        scope = ",".join(t["nodes"]) or "-"
        for key, names in (("cluster", t.get("clusters") or ()), ("role", t.get("node_roles") or ())):
            if names:
                scope += f" {key}={','.join(names)}"
        # each field made printable on its own: the separators are real tabs, not escaped ones
        fields = (t["token_id"], t["role"], scope, f"created {format_utc(t['created_ns'])}", state, t["note"])
        click.echo("\t".join(printable(str(f)) for f in fields))


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
