"""A request's transfer events as the engines join them: its own, and a bootstrap room's sends prefill recorded
under its own request id (``docs/findings.md``, "Bootstrap rooms"), for the drill-down of one request."""

from __future__ import annotations

import duckdb
import pyarrow as pa

from kvtrail.forensics.sql.joins import TRANSFER_CTES

# Over the transfer ids the request names; ``treq`` is the request each event belongs to after the room join.
_TRANSFERS = f"""
WITH ev AS (SELECT e.*, e.request_id AS rid_text FROM events_v e
            SEMI JOIN (SELECT cluster, transfer_id FROM events_v
                       WHERE kind IN ('transfer_reserved', 'transfer_sent', 'transfer_received')
                         AND request_id = ? AND (? IS NULL OR tenant_id = ?)) m
              ON m.cluster = e.cluster AND m.transfer_id = e.transfer_id
            WHERE e.kind IN ('transfer_reserved', 'transfer_sent', 'transfer_received')),
{TRANSFER_CTES}
SELECT kind, node, wall_ns, transfer_id, num_tokens, num_pages, digest, digest_algo, status FROM txk
WHERE (request_id = ? AND (? IS NULL OR tenant_id = ?)) OR (treq = ? AND request_id <> ?)
ORDER BY wall_ns, node"""


def request_transfers(con: duckdb.DuckDBPyConnection, request_id: str, tenant: str | None) -> pa.Table:
    """``request_id``'s transfer events (only those naming ``tenant`` when given) and its rooms' sends by
    prefill's request, in time order: kind, node, wall_ns, transfer_id, num_tokens, num_pages, digest,
    digest_algo, status."""
    params = [request_id, tenant, tenant, request_id, tenant, tenant, request_id, request_id]
    return con.sql(_TRANSFERS, params=params).to_arrow_table()
