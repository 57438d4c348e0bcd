"""API tokens: roles, salted hashes in the store, constant-time checks, revocation and the token file.

A token is ``kvt_<token_id>_<secret>``: the id is public (it names the token in ``kvtrail token list``
and in the access log), the secret is 256 random bits shown once. The store keeps only
``pbkdf2-sha256$<iterations>$<salt hex>$<hash hex>`` with a per-token salt. The secret is random, not a
password, so a guess costs 2**256 whatever the iteration count; the salt and the iterations only
guard against precomputed tables, which keeps a check cheap enough to run on every request.

Roles: ``producer`` (ingest only; optionally bound to node names, and to clusters and node roles:
a batch is accepted only from a producer identity within every binding given), ``operator``
(everything) and ``tenant:<id>`` (queries about that tenant's own requests). Any token may expire
(``expires_ns``): from then on it is refused (401) like a revoked one.

Token file (``kvtrail serve --tokens FILE``), one token per line, ``#`` starts a comment::

    <token_id> <role> <hash> [nodes=<node>,...] [clusters=<cluster>,...] [node_roles=<role>,...]
        [expires=<UTC ns>] [note=<text without spaces>]

``kvtrail token add --file FILE --role ROLE`` appends such a line and prints the secret; the file
holds no secret, only hashes.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import duckdb

from kvtrail.audit.events import ROLES
from kvtrail.service import access

TABLE = "api_tokens"
ITERATIONS = 2_000
SIMPLE_ROLES = ("producer", "operator", "metrics")  # metrics: GET /metrics only (serve --metrics-token)
_ID = re.compile(r"^[0-9a-f]{12}$")
_TENANT = re.compile(r"^[^\s:]{1,200}$")
_NODE = re.compile(r"^[^\s,]{1,200}$")
_DUMMY = "pbkdf2-sha256$%d$%s$%s" % (ITERATIONS, "00" * 16, "00" * 32)
_DURATION = re.compile(r"^(\d{1,9})([smhdw])$")
_UNIT_NS = {"s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9, "d": 86_400 * 10**9, "w": 7 * 86_400 * 10**9}
MAX_LIFETIME_NS = 10 * 366 * 86_400 * 10**9  # ten years: a longer expiry is a typo


@dataclass(frozen=True)
class Principal:
    """Who a request's token belongs to. ``role`` is ``producer``, ``operator`` or ``tenant``."""

    token_id: str
    role: str
    tenant_id: str | None
    nodes: tuple[str, ...] = ()
    clusters: tuple[str, ...] = ()  # producer tokens: the clusters it may send for (none: any)
    node_roles: tuple[str, ...] = ()  # ... and the node roles (none: any)
    expires_ns: int | None = None

    def expired(self, now_ns: int | None = None) -> bool:
        return self.expires_ns is not None and (time.time_ns() if now_ns is None else now_ns) >= self.expires_ns

    @property
    def role_name(self) -> str:
        """The role as written on the command line (``tenant:<id>`` for tenants)."""
        return f"tenant:{self.tenant_id}" if self.role == "tenant" else self.role


def parse_role(role: str) -> tuple[str, str | None]:
    """``producer`` / ``operator`` / ``metrics`` / ``tenant:<id>`` -> (role, tenant id); ValueError naming ``role``."""
    if role in SIMPLE_ROLES:
        return role, None
    if role.startswith("tenant:") and _TENANT.match(role[len("tenant:") :]):
        return "tenant", role[len("tenant:") :]
    raise ValueError(f"role: {role!r} is not producer, operator, metrics or tenant:<id> (an id without spaces or ':')")


def _check_nodes(role: str, nodes: tuple[str, ...], what: str = "node") -> tuple[str, ...]:
    if nodes and role != "producer":
        raise ValueError(f"{what}: only a producer token is bound to {what} names")
    for n in nodes:
        if not _NODE.match(n):
            raise ValueError(f"{what}: {n!r} is not a {what} name (no spaces or commas)")
        if what == "node-role" and n not in ROLES:
            raise ValueError(f"node-role: {n!r} is not one of {', '.join(ROLES)}")
    return tuple(sorted(set(nodes)))


@dataclass(frozen=True)
class Binding:
    """What a producer token may send for (each empty: any) and when any token stops working."""

    nodes: tuple[str, ...] = ()
    clusters: tuple[str, ...] = ()
    node_roles: tuple[str, ...] = ()
    expires_ns: int | None = None

    def checked(self, role: str) -> "Binding":
        """The binding with its names checked and sorted for ``role``; ValueError naming the option."""
        kind, _ = parse_role(role)
        if self.expires_ns is not None and self.expires_ns <= 0:
            raise ValueError(f"expires: {self.expires_ns} is not a time")
        return Binding(
            _check_nodes(kind, self.nodes),
            _check_nodes(kind, self.clusters, "cluster"),
            _check_nodes(kind, self.node_roles, "node-role"),
            self.expires_ns,
        )


def parse_duration(text: str) -> int:
    """``90d``, ``12h``, ``30m``, ``3600s``, ``2w`` in ns; ValueError naming ``expires-in``."""
    m = _DURATION.match(text.strip())
    if not m or int(m.group(1)) == 0:
        raise ValueError(f"expires-in: {text!r} is not a duration like 30m, 12h, 90d or 2w")
    ns = int(m.group(1)) * _UNIT_NS[m.group(2)]
    if ns > MAX_LIFETIME_NS:
        raise ValueError(f"expires-in: {text!r} is more than ten years")
    return ns


def hash_secret(secret: str, *, salt: bytes | None = None, iterations: int = ITERATIONS) -> str:
    """The stored form of a secret: ``pbkdf2-sha256$<iterations>$<salt hex>$<hash hex>``."""
    salt = secrets.token_bytes(16) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha256", secret.encode(), salt, iterations)
    return f"pbkdf2-sha256${iterations}${salt.hex()}${digest.hex()}"


def check_secret(secret: str, stored: str) -> bool:
    """Whether ``secret`` hashes to ``stored``, compared in constant time."""
    scheme, iterations, salt, digest = stored.split("$")
    assert scheme == "pbkdf2-sha256", f"unknown token hash scheme {scheme}"
    again = hashlib.pbkdf2_hmac("sha256", secret.encode(), bytes.fromhex(salt), int(iterations))
    return hmac.compare_digest(again, bytes.fromhex(digest))


def _check_hash(text: str) -> str:
    parts = text.split("$")
    ok = (
        len(parts) == 4
        and parts[0] == "pbkdf2-sha256"
        and parts[1].isdigit()
        and 1 <= int(parts[1]) <= 10**7
        and re.fullmatch(r"[0-9a-f]{16,128}", parts[2]) is not None
        and re.fullmatch(r"[0-9a-f]{64}", parts[3]) is not None
    )
    if not ok:
        raise ValueError("hash: not pbkdf2-sha256$<iterations>$<salt hex>$<sha256 hex>")
    return text


def ensure_tables(con: duckdb.DuckDBPyConnection) -> None:
    """Create the token table (and the access log it records changes in) if the store has none yet."""
    con.execute(
        f"CREATE TABLE IF NOT EXISTS {TABLE} (token_id VARCHAR PRIMARY KEY, role VARCHAR NOT NULL, "
        "tenant_id VARCHAR, nodes VARCHAR[] NOT NULL, note VARCHAR NOT NULL, hash VARCHAR NOT NULL, "
        "created_ns BIGINT NOT NULL, revoked_ns BIGINT)"
    )
    # added since the first token table: stores made before get them, empty (no binding, no expiry)
    for column, type_ in (("clusters", "VARCHAR[]"), ("node_roles", "VARCHAR[]"), ("expires_ns", "BIGINT")):
        con.execute(f"ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS {column} {type_}")
    access.ensure_table(con)


def new_token(role: str, *, nodes: tuple[str, ...] = (), binding: Binding | None = None) -> tuple[str, str, str]:
    """A fresh token without storing it: (token_id, secret token string, stored hash)."""
    (binding or Binding(nodes)).checked(role)
    token_id = secrets.token_hex(6)
    secret = f"kvt_{token_id}_{secrets.token_urlsafe(32)}"
    return token_id, secret, hash_secret(secret)


def _insert(
    con: duckdb.DuckDBPyConnection, token_id: str, role: str, stored: str, *, note: str, binding: Binding, actor: str
) -> None:
    kind, tenant = parse_role(role)
    b = binding.checked(role)
    ensure_tables(con)
    con.execute(
        f"INSERT INTO {TABLE} (token_id, role, tenant_id, nodes, note, hash, created_ns, revoked_ns, "
        "clusters, node_roles, expires_ns) VALUES (?, ?, ?, ?, ?, ?, ?, NULL, ?, ?, ?)",
        [
            token_id,
            kind,
            tenant,
            list(b.nodes),
            note,
            stored,
            time.time_ns(),
            list(b.clusters),
            list(b.node_roles),
            b.expires_ns,
        ],
    )
    change = {"token_id": token_id, "role": role, "nodes": ",".join(b.nodes)}
    if b.clusters or b.node_roles:
        change.update(clusters=",".join(b.clusters), node_roles=",".join(b.node_roles))
    if b.expires_ns is not None:
        change["expires_ns"] = str(b.expires_ns)
    access.append(con, access.AccessEntry(None, actor, "TOKEN", "add", change, 200))


def add_token(
    con: duckdb.DuckDBPyConnection,
    role: str,
    *,
    note: str = "",
    nodes: tuple[str, ...] = (),
    binding: Binding | None = None,
    actor: str = "local",
) -> tuple[str, str]:
    """Store a new token for ``role``; returns (token_id, secret token string). Only its hash is kept.
    ``binding`` (or just ``nodes``): what a producer token may send for, and when the token expires."""
    binding = binding or Binding(nodes)
    token_id, secret, stored = new_token(role, binding=binding)
    _insert(con, token_id, role, stored, note=note, binding=binding, actor=actor)
    return token_id, secret


def authenticate(con: duckdb.DuckDBPyConnection, secret: str) -> Principal | None:
    """The principal of a presented token; None for an unknown, malformed, revoked or expired one.

    An unknown id still costs one hash check, so timing tells little about which ids exist.
    """
    parts = secret.split("_", 2)
    token_id = parts[1] if len(parts) == 3 and parts[0] == "kvt" and _ID.match(parts[1]) else ""
    row = None
    if token_id:
        row = con.execute(
            f"SELECT role, tenant_id, nodes, hash, revoked_ns, clusters, node_roles, expires_ns "
            f"FROM {TABLE} WHERE token_id = ?",
            [token_id],
        ).fetchone()
    matches = check_secret(secret, row[3] if row else _DUMMY)
    if row is None or not matches or row[4] is not None:
        return None
    who = Principal(token_id, row[0], row[1], tuple(row[2]), tuple(row[5] or ()), tuple(row[6] or ()), row[7])
    return None if who.expired() else who


@dataclass(frozen=True)
class TokenInfo:
    """A stored token as ``kvtrail token list`` shows it (never its hash)."""

    token_id: str
    role: str
    nodes: tuple[str, ...]
    note: str
    created_ns: int
    revoked_ns: int | None
    clusters: tuple[str, ...] = ()
    node_roles: tuple[str, ...] = ()
    expires_ns: int | None = None


def list_tokens(con: duckdb.DuckDBPyConnection) -> list[TokenInfo]:
    """Every stored token, revoked ones included, oldest first."""
    ensure_tables(con)
    rows = con.execute(
        f"SELECT token_id, role, tenant_id, nodes, note, created_ns, revoked_ns, clusters, node_roles, "
        f"expires_ns FROM {TABLE} ORDER BY created_ns, token_id"
    ).fetchall()
    return [
        TokenInfo(
            r[0],
            f"tenant:{r[2]}" if r[1] == "tenant" else r[1],
            tuple(r[3]),
            r[4],
            r[5],
            r[6],
            tuple(r[7] or ()),
            tuple(r[8] or ()),
            r[9],
        )
        for r in rows
    ]


def revoke_token(con: duckdb.DuckDBPyConnection, token_id: str, *, actor: str = "local") -> bool:
    """Revoke ``token_id``; False when it was already revoked. ValueError when there is no such token."""
    ensure_tables(con)
    row = con.execute(f"SELECT revoked_ns FROM {TABLE} WHERE token_id = ?", [token_id]).fetchone()
    if row is None:
        raise ValueError(f"token_id: no token {token_id!r}")
    if row[0] is not None:
        return False
    con.execute(f"UPDATE {TABLE} SET revoked_ns = ? WHERE token_id = ?", [time.time_ns(), token_id])
    access.append(con, access.AccessEntry(None, actor, "TOKEN", "revoke", {"token_id": token_id}, 200))
    return True


def token_line(
    token_id: str,
    role: str,
    stored: str,
    *,
    nodes: tuple[str, ...] = (),
    note: str = "",
    binding: Binding | None = None,
) -> str:
    """One line of a token file."""
    b = binding or Binding(nodes)
    line = f"{token_id} {role} {stored}"
    for key, names in (("nodes", b.nodes), ("clusters", b.clusters), ("node_roles", b.node_roles)):
        if names:
            line += f" {key}=" + ",".join(names)
    if b.expires_ns is not None:
        line += f" expires={b.expires_ns}"
    if note:
        line += " note=" + re.sub(r"\s+", "_", note)
    return line


def load_token_file(con: duckdb.DuckDBPyConnection, path: str | Path, *, actor: str = "token-file") -> int:
    """Add the tokens of a token file (format in the module docstring) that the store lacks; returns how many.

    A token already stored with the same hash is left as it is (a revoked one stays revoked); the same
    id with another hash, or any malformed line, is a ValueError naming the line, and nothing is added.
    """
    parsed: list[tuple[str, str, str, Binding, str]] = []
    for line_no, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        try:
            if len(fields) < 3 or not _ID.match(fields[0]):
                raise ValueError("expected '<token_id> <role> <hash> [nodes=...] [note=...]' (a 12-hex-digit id)")
            parse_role(fields[1])
            names: dict[str, tuple[str, ...]] = {}
            expires: int | None = None
            note = ""
            for extra in fields[3:]:
                key, _, value = extra.partition("=")
                if key in ("nodes", "clusters", "node_roles") and value:
                    names[key] = tuple(value.split(","))
                elif key == "expires" and value.isdigit():
                    expires = int(value)
                elif key == "note":
                    note = value
                else:
                    raise ValueError(f"unknown field {extra!r} (nodes=, clusters=, node_roles=, expires=<ns> or note=)")
            binding = Binding(
                names.get("nodes", ()), names.get("clusters", ()), names.get("node_roles", ()), expires
            ).checked(fields[1])
            parsed.append((fields[0], fields[1], _check_hash(fields[2]), binding, note))
        except ValueError as exc:
            raise ValueError(f"tokens file {Path(path).name} line {line_no}: {exc}") from None
    ensure_tables(con)
    added = 0
    for token_id, _role, stored, _nodes, _note in parsed:
        row = con.execute(f"SELECT hash FROM {TABLE} WHERE token_id = ?", [token_id]).fetchone()
        if row is not None and row[0] != stored:
            raise ValueError(f"tokens file {Path(path).name}: token {token_id} is stored with another hash")
    for token_id, role, stored, binding, note in parsed:
        if con.execute(f"SELECT count(*) FROM {TABLE} WHERE token_id = ?", [token_id]).fetchone() == (0,):
            _insert(con, token_id, role, stored, note=note, binding=binding, actor=actor)
            added += 1
    return added
