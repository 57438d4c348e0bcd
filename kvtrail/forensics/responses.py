"""Responses by the request they answer. A request is its (id, tenant): a client may choose its request id,
so two tenants' requests that share an id text never lend each other their responses."""

from __future__ import annotations

import duckdb

Response = tuple  # (http_status, prompt_tokens, completion_tokens)
_NO_RESPONSE: Response = (None, None, None)


def responses_by_request(con: duckdb.DuckDBPyConnection) -> dict[str, dict[str | None, Response]]:
    """Each response by its request id, then its tenant (the latest response of a request if it has more)."""
    out: dict[str, dict[str | None, Response]] = {}
    for rid, tenant, *rest in con.execute(
        "SELECT request_id, tenant_id, http_status, prompt_tokens, completion_tokens FROM events_v "
        "WHERE kind = 'response_sent' AND request_id IS NOT NULL ORDER BY wall_ns"
    ).fetchall():
        out.setdefault(rid, {})[tenant] = tuple(rest)
    return out


def response_of(responses: dict[str, dict[str | None, Response]], rid: str, tenant: str | None) -> Response:
    """The response of request (``rid``, ``tenant``): the one its tenant's request sent, else one that names no
    tenant; a request of no known tenant gets its id's only response. Never another tenant's response."""
    by_tenant = responses.get(rid, {})
    if tenant in by_tenant:
        return by_tenant[tenant]
    if None in by_tenant:
        return by_tenant[None]
    if tenant is None and len(by_tenant) == 1:
        return next(iter(by_tenant.values()))
    return _NO_RESPONSE
