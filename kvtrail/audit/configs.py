"""The store's node configurations (``node_config`` events), read one way for every reader.

- :func:`latest_configs`: the newest configuration of each node (or producer, or node and role) at or
  before a time, ties broken by the later sequence number;
- :func:`configs_in_effect`: every configuration in effect during a window (each producer's newest at
  or before its start, and every later one up to its end);
- :func:`unaudited_paths`: what a node's ``config_source`` declares its record does not cover (the SGLang
  plugin's ``hooks missing: ...`` and ``not audited: ...``).

The metrics, the Fleet view and the thresholds analysis read them here; the SQL findings engine keeps
its own statement of F8's inputs so that it stays independent of the replay (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import duckdb
import pyarrow as pa

from kvtrail.audit.store import arrow_query

_MIN_NS, _MAX_NS = -(2**63), 2**63 - 1


def latest_configs(
    con: duckdb.DuckDBPyConnection,
    columns: Sequence[str],
    *,
    per: Sequence[str] = ("producer_id",),
    at_ns: int | None = None,
    order_by: Sequence[str] = (),
) -> pa.Table:
    """``columns`` of the newest ``node_config`` of each ``per`` group at or before ``at_ns`` (all time
    when None)."""
    bound = "" if at_ns is None else " AND wall_ns <= ?"
    order = f" ORDER BY {', '.join(order_by)}" if order_by else ""
    return arrow_query(
        con,
        f"""
        SELECT {", ".join(columns)} FROM events_v WHERE kind = 'node_config'{bound}
        QUALIFY row_number() OVER (PARTITION BY {", ".join(per)} ORDER BY wall_ns DESC, seq DESC) = 1{order}""",
        [] if at_ns is None else [at_ns],
    )


def configs_in_effect(
    con: duckdb.DuckDBPyConnection, columns: Sequence[str], from_ns: int | None, to_ns: int | None
) -> pa.Table:
    """``columns`` of every ``node_config`` in effect during [from_ns, to_ns], by node then time."""
    lo, hi = _MIN_NS if from_ns is None else from_ns, _MAX_NS if to_ns is None else to_ns
    return arrow_query(
        con,
        f"""
        SELECT {", ".join(columns)} FROM events_v c WHERE kind = 'node_config' AND wall_ns <= ?
          AND wall_ns >= coalesce((SELECT max(wall_ns) FROM events x WHERE x.kind = 'node_config'
                                   AND x.producer_id = c.producer_id AND x.wall_ns <= ?), ?)
        ORDER BY node, wall_ns, instance""",
        [hi, lo, lo],
    )


# The parts of a config_source the SGLang plugin writes ("sglang-plugin; hooks all patched; not audited: a,b"):
# parts split by "; ", names in a part by ",".
HOOKS_MISSING, NOT_AUDITED = "hooks missing: ", "not audited: "


def unaudited_paths(config_source: str | None) -> list[str]:
    """The paths a node's record does not cover, as its ``config_source`` declares them: each mode or backend
    named ``not audited``, and ``hook not patched: <target>`` for each hook target that was not patched."""
    out: list[str] = []
    for part in (config_source or "").split("; "):
        if part.startswith(NOT_AUDITED):
            out += [p for p in part[len(NOT_AUDITED) :].split(",") if p]
        elif part.startswith(HOOKS_MISSING):
            out += [f"hook not patched: {p}" for p in part[len(HOOKS_MISSING) :].split(",") if p]
    return out
