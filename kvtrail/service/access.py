"""The access log: every query and every token change, one row each, chained by SHA-256 like the audit batches.

Each entry's ``digest`` is SHA-256 over the previous entry's digest and the entry's canonical JSON, so
editing, deleting or reordering a row breaks the chain from that row on (:func:`verify_access_log`).
Query parameters are stored as given minus anything secret (see :data:`SECRET_PARAMS`), and anything
token-shaped (``kvt_...``) in a parameter's name or value, or in the path, whatever the name, is stored
as ``kvt_<id>_[redacted]`` (:func:`redact`); the token's secret is never stored, only its public id.

In the service every append runs under ``ServiceState.write_lock`` (it reads the last digest and
inserts in one transaction); the ``kvtrail token`` commands own the store alone and need no lock.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

import duckdb

TABLE = "access_log"
GENESIS = bytes(32)
# Parameter names that never reach the log (a client may put its token in the query string by mistake).
SECRET_PARAMS = frozenset({"token", "access_token", "authorization", "secret", "password"})
# A token as `kvtrail token add` prints it (kvt_<12 hex id>_<secret>), or anything that starts like one.
_TOKEN_SHAPED = re.compile(r"kvt_([0-9a-f]{12}_)?[^\s&?#/\"',;]*", re.IGNORECASE)
_FIELDS = ("entry_no", "wall_ns", "token_id", "role", "method", "path", "query", "status")


def ensure_table(con: duckdb.DuckDBPyConnection) -> None:
    """Create the access log table if the store has none yet."""
    con.execute(
        f"CREATE TABLE IF NOT EXISTS {TABLE} (entry_no BIGINT PRIMARY KEY, wall_ns BIGINT NOT NULL, "
        "token_id VARCHAR, role VARCHAR, method VARCHAR NOT NULL, path VARCHAR NOT NULL, "
        "query VARCHAR NOT NULL, status INTEGER NOT NULL, prev_digest BLOB NOT NULL, digest BLOB NOT NULL)"
    )


@dataclass(frozen=True)
class AccessEntry:
    """One access: who (token id and role; None when no valid token came), what, its HTTP status, when."""

    token_id: str | None
    role: str | None
    method: str
    path: str
    query: Mapping[str, object]
    status: int
    wall_ns: int = 0


def redact(text: str) -> str:
    """``text`` with every token-shaped part replaced by ``kvt_<id>_[redacted]`` (the id is public)."""
    return _TOKEN_SHAPED.sub(lambda m: f"kvt_{m.group(1) or ''}[redacted]", text)


def _redacted(value: object) -> object:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, (list, tuple)):
        return [_redacted(v) for v in value]
    return value


def scrub(params: Mapping[str, object]) -> dict[str, object]:
    """``params`` without secret-looking keys and with token-shaped text redacted in the other keys and
    their values, keys sorted (so the canonical form is stable)."""
    return {redact(k): _redacted(params[k]) for k in sorted(params) if k.lower() not in SECRET_PARAMS}


def entry_digest(prev_digest: bytes, row: Mapping[str, object]) -> bytes:
    """The chained digest of one stored row (its fields in :data:`_FIELDS`, ``query`` as stored text)."""
    canon = json.dumps({k: row[k] for k in _FIELDS}, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(prev_digest + canon.encode()).digest()


def append(con: duckdb.DuckDBPyConnection, entry: AccessEntry) -> int:
    """Append ``entry`` to the chain in one transaction; returns its entry number.

    The caller holds the store's write lock when other threads write on the same database.
    """
    ensure_table(con)
    con.begin()
    try:
        last = con.execute(f"SELECT entry_no, digest FROM {TABLE} ORDER BY entry_no DESC LIMIT 1").fetchone()
        entry_no, prev = (0, GENESIS) if last is None else (int(last[0]) + 1, bytes(last[1]))
        row = {
            "entry_no": entry_no,
            "wall_ns": entry.wall_ns or time.time_ns(),
            "token_id": entry.token_id,
            "role": entry.role,
            "method": entry.method,
            "path": redact(entry.path),
            "query": json.dumps(scrub(entry.query), sort_keys=True, separators=(",", ":"), default=str),
            "status": int(entry.status),
        }
        digest = entry_digest(prev, row)
        con.execute(
            f"INSERT INTO {TABLE} VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", [*(row[k] for k in _FIELDS), prev, digest]
        )
        con.commit()
    except BaseException:
        con.rollback()
        raise
    return entry_no


@dataclass(frozen=True)
class AccessVerification:
    """The result of checking the access log chain: ``first_bad`` is the first entry that does not verify."""

    entries: int
    ok: bool
    first_bad: int | None = None
    reason: str = ""
    head_digest: str = ""


def verify_access_log(con: duckdb.DuckDBPyConnection) -> AccessVerification:
    """Recompute the chain from the first entry: numbering without holes, each prev digest the previous
    digest, each digest the hash of its row."""
    has = con.execute(
        f"SELECT count(*) FROM duckdb_tables() WHERE table_name = '{TABLE}' AND schema_name = 'main' "
        "AND database_name = current_database()"
    ).fetchone()
    if not has or not has[0]:
        return AccessVerification(0, True)
    cols = ", ".join(_FIELDS)
    rows = con.execute(f"SELECT {cols}, prev_digest, digest FROM {TABLE} ORDER BY entry_no").fetchall()
    prev = GENESIS
    for i, values in enumerate(rows):
        row = dict(zip(_FIELDS, values[: len(_FIELDS)]))
        stored_prev, stored = bytes(values[-2]), bytes(values[-1])
        if row["entry_no"] != i:
            return AccessVerification(len(rows), False, i, f"entry {i} is missing (found {row['entry_no']})")
        if stored_prev != prev:
            return AccessVerification(len(rows), False, i, f"entry {i}: prev_digest is not entry {i - 1}'s digest")
        if entry_digest(prev, row) != stored:
            return AccessVerification(len(rows), False, i, f"entry {i}: digest does not match its row")
        prev = stored
    return AccessVerification(len(rows), True, head_digest=prev.hex() if rows else "")
