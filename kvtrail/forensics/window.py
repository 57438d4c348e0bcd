"""The forensic window: a UTC span in ns with optional tenant and node filters, and its store filter.

Both engines (replay and SQL) and every question read the same window the same way: each producer is
read from its last ``node_config`` at or before the window's start (so page state at the start is
known), up to its end.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb

from kvtrail.errors import KvtrailError


@dataclass(frozen=True)
class Window:
    """A UTC window in ns, with optional tenant and node filters (validated against the store)."""

    from_ns: int | None = None
    to_ns: int | None = None
    tenant: str | None = None
    node: str | None = None


def check_window(con: duckdb.DuckDBPyConnection, w: Window) -> None:
    """Refuse a window that ends before it starts, or a tenant or node the store has never seen."""
    if w.from_ns is not None and w.to_ns is not None and w.from_ns > w.to_ns:
        raise KvtrailError("--from: is after --to")
    for field, column, value in (("--tenant", "tenant_id", w.tenant), ("--node", "node", w.node)):
        if value is None:
            continue
        known = [
            r[0]
            for r in con.execute(
                f"SELECT DISTINCT {column} FROM events_v WHERE {column} IS NOT NULL ORDER BY 1"
            ).fetchall()
        ]
        if value not in known:
            raise KvtrailError(f"{field}: unknown {column.split('_')[0]} {value!r}; known: {', '.join(known[:20])}")


def window_filter(from_ns: int | None, to_ns: int | None) -> tuple[str, list]:
    """SQL filter on ``events_v`` for a window: each producer from its last node_config at or before
    ``from_ns`` (so page state at the window's start is known), up to ``to_ns``."""
    where, params = ["TRUE"], []
    if from_ns is not None:
        where.append(
            "wall_ns >= coalesce((SELECT max(c.wall_ns) FROM events c WHERE c.kind = 'node_config' "
            "AND c.producer_id = events_v.producer_id AND c.wall_ns <= ?), ?)"
        )
        params += [from_ns, from_ns]
    if to_ns is not None:
        where.append("wall_ns <= ?")
        params.append(to_ns)
    return " AND ".join(where), params


def kind_window_filter(from_ns: int | None, to_ns: int | None, alias: str) -> tuple[str, list]:
    """:func:`window_filter` for the rows of one kind's table as ``alias`` (``layout.kind_rows``): the same
    rows of that kind, with the node_config looked up in its own table."""
    where, params = ["TRUE"], []
    if from_ns is not None:
        where.append(
            f"{alias}.wall_ns >= coalesce((SELECT max(c.wall_ns) FROM events_node_config c "
            f"WHERE c.producer_id = {alias}.producer_id AND c.wall_ns <= ?), ?)"
        )
        params += [from_ns, from_ns]
    if to_ns is not None:
        where.append(f"{alias}.wall_ns <= ?")
        params.append(to_ns)
    return " AND ".join(where), params
