"""Chain heads kept outside the store: per producer its latest batch (``kvtrail audit head``), their
saved form checked for shape, and a store compared with them, so a rewrite of the newest batches that
re-chains them is still caught (:mod:`kvtrail.audit.verify` checks the chain itself)."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb

from kvtrail.audit.verify import Problem
from kvtrail.errors import KvtrailError

_HEAD_FIELDS: dict[str, type] = {"producer_id": int, "batch_no": int, "last_seq": int, "digest": str}


def chain_heads(con: duckdb.DuckDBPyConnection, table: str = "batches", producers: str = "producers") -> list[dict]:
    """Per producer: its latest batch (number, last seq, digest as hex), with the producer's node and instance
    (``table``/``producers``: where the batches and producers are, e.g. an attached store's).

    ``kvtrail audit head --json`` prints these; :func:`compare_heads` checks a store against a saved copy.
    """
    rows = con.execute(
        f"SELECT b.producer_id, p.node, p.instance, b.batch_no, b.last_seq, b.digest FROM {table} b "
        f"JOIN {producers} p USING (producer_id) "
        "QUALIFY row_number() OVER (PARTITION BY b.producer_id ORDER BY b.batch_no DESC) = 1 "
        "ORDER BY b.producer_id"
    ).fetchall()
    return [
        {
            "producer_id": int(pid),
            "node": node,
            "instance": inst,
            "batch_no": int(no),
            "last_seq": int(last),
            "digest": bytes(digest).hex(),
        }
        for pid, node, inst, no, last, digest in rows
    ]


def parse_heads(doc, source: str, path: str = "heads") -> list[dict]:
    """Check the shape of saved heads (a list of :func:`chain_heads` entries at ``path`` in ``source``).

    Raises KvtrailError naming the source and the field, e.g. ``heads.json: field 'heads[2].digest': ...``.
    """

    def bad(field: str, reason: str) -> KvtrailError:
        return KvtrailError(f"{source}: field '{field}': {reason}")

    if not isinstance(doc, list):
        raise bad(path, "must be a list of chain heads (the output of 'kvtrail audit head --json')")
    for i, h in enumerate(doc):
        where = f"{path}[{i}]"
        if not isinstance(h, dict):
            raise bad(where, "must be an object")
        for name, type_ in _HEAD_FIELDS.items():
            value = h.get(name)
            if not isinstance(value, type_) or isinstance(value, bool):
                raise bad(f"{where}.{name}", "missing" if value is None else f"must be {type_.__name__}")
            if isinstance(value, int) and value < 0:
                raise bad(f"{where}.{name}", "must be >= 0")
        if len(h["digest"]) != 64 or any(c not in "0123456789abcdefABCDEF" for c in h["digest"]):
            raise bad(f"{where}.digest", "must be a SHA-256 digest in hex (64 characters)")
        if h.get("node") is not None and not isinstance(h["node"], str):
            raise bad(f"{where}.node", "must be a string")
    return doc


def load_heads(path: str | Path) -> list[dict]:
    """Read a file written by ``kvtrail audit head --json``: ``{"heads": [...]}``."""
    name = str(path)
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise KvtrailError(f"{name}: cannot read ({exc.strerror})") from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError both
        raise KvtrailError(f"{name}: not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or "heads" not in doc:
        raise KvtrailError(f"{name}: field 'heads': missing (expected the output of 'kvtrail audit head --json')")
    return parse_heads(doc["heads"], name)


def compare_heads(con: duckdb.DuckDBPyConnection, heads: list[dict]) -> list[Problem]:
    """Check that the store still holds each saved head; one problem per producer that does not.

    *Behind*: the producer's newest batch is older than the saved head (batches deleted from the
    end, which the chain alone cannot show). *Forked*: the store's batch at the saved head's position
    has another digest (or is absent), so the chain was rewritten from there. A producer missing from
    the store is named too. Producers the saved heads do not mention are not checked.
    """
    now = {h["producer_id"]: h for h in chain_heads(con)}
    problems = []
    for h in heads:
        pid, batch_no, digest = h["producer_id"], h["batch_no"], h["digest"].lower()
        cur = now.get(pid)
        saved = f"batch {batch_no}, seq {h['last_seq']}"
        if cur is None:
            row = con.execute("SELECT node FROM producers WHERE producer_id = ?", [pid]).fetchone()
            what = (
                "behind the saved head: the store holds no batch of it"
                if row
                else "missing: the producer is not in the store"
            )
            problems.append(Problem(pid, row[0] if row else h.get("node"), batch_no, f"{what} (saved head {saved})"))
            continue
        node = cur["node"]
        if cur["batch_no"] < batch_no or cur["last_seq"] < h["last_seq"]:
            problems.append(
                Problem(
                    pid,
                    node,
                    batch_no,
                    f"behind the saved head: the store ends at batch {cur['batch_no']}, seq "
                    f"{cur['last_seq']}, the saved head is {saved} (newest batches deleted?)",
                )
            )
            continue
        row = con.execute(
            "SELECT digest FROM batches WHERE producer_id = ? AND batch_no = ?", [pid, batch_no]
        ).fetchone()
        if row is None:
            problems.append(
                Problem(
                    pid,
                    node,
                    batch_no,
                    f"forked from the saved head: the store has no batch {batch_no} (saved head {saved})",
                )
            )
        elif bytes(row[0]).hex() != digest:
            problems.append(
                Problem(
                    pid,
                    node,
                    batch_no,
                    f"digest differs ({bytes(row[0]).hex()[:16]}... now, {digest[:16]}... saved): "
                    "forked from the saved head",
                )
            )
    return problems
