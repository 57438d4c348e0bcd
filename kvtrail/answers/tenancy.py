"""What a tenant token may learn, computed from the same answers operators get.

A tenant sees its own requests and counts about everyone else: how many other requests and tenants
its responses read from, how many responses and tenants read its data. Another tenant's ids, request
ids and node names never leave these functions; the query router sends nothing else to a tenant.
"""

from __future__ import annotations

import polars as pl

from kvtrail.forensics import AFFECTED_CODES, PSEUDO_VICTIMS

_AFFECTED_SCHEMA: dict[str, pl.DataType | type[pl.DataType]] = {
    "request_id": pl.Utf8,
    "http_status": pl.Int32,
    "prompt_tokens": pl.Int64,
    "completion_tokens": pl.Int64,
    "codes": pl.List(pl.Utf8),
    "pages_read_foreign": pl.Int64,
    "other_requests": pl.Int64,
    "other_tenants": pl.Int64,
    "first_ns": pl.Int64,
    "last_ns": pl.Int64,
}


def _others(tenants: list[str] | None, tenant: str) -> int:
    return len({t for t in tenants or () if t != tenant and t not in PSEUDO_VICTIMS})


def tenant_affected(affected: pl.DataFrame, tenant: str) -> pl.DataFrame:
    """The tenant's own affected responses (rows of ``ask_affected``), victims reduced to counts."""
    rows = [
        {
            "request_id": r["request_id"],
            "http_status": r["http_status"],
            "prompt_tokens": r["prompt_tokens"],
            "completion_tokens": r["completion_tokens"],
            "codes": r["codes"],
            "pages_read_foreign": r["pages_read_foreign"],
            "other_requests": len(r["victim_requests"] or ()),
            "other_tenants": _others(r["victim_tenants"], tenant),
            "first_ns": r["first_ns"],
            "last_ns": r["last_ns"],
        }
        for r in affected.filter(pl.col("tenant_id") == tenant).iter_rows(named=True)
    ]
    return pl.DataFrame(rows, schema=_AFFECTED_SCHEMA)


def _reads_of(findings: pl.DataFrame, match) -> tuple[set, set, set, set]:
    """(reading responses, their tenants, pages read, matched victim request ids) of affected findings whose
    victim (request id, tenant id) satisfies ``match``."""
    responses: set[str] = set()
    tenants: set[str | None] = set()
    pages: set[tuple] = set()
    mine: set[str] = set()
    for f in findings.filter(pl.col("code").is_in(sorted(AFFECTED_CODES))).iter_rows(named=True):
        hits = [rid for rid, tid in zip(f["victim_request_ids"] or (), f["victim_tenant_ids"] or ()) if match(rid, tid)]
        if not hits:
            continue
        responses.add(f["request_id"])
        tenants.add(f["tenant_id"])
        pages.update((f["request_id"], f["node"], p) for p in f["pages"] or ())
        mine.update(h for h in hits if h)
    return responses, tenants, pages, mine


def tenant_exposure(findings: pl.DataFrame, tenant: str) -> dict:
    """Whether other tenants' responses read the tenant's data (from ``ask_findings`` rows), and how much; reads
    by the tenant's own other requests counted apart (``same_tenant_*``), as the disclosure report counts them."""
    mine = findings.filter(pl.col("tenant_id") == tenant)
    others = findings.filter(pl.col("tenant_id").is_null() | (pl.col("tenant_id") != tenant))
    responses, tenants, pages, read = _reads_of(others, lambda rid, tid: tid == tenant)
    own_responses, _, own_pages, own_read = _reads_of(mine, lambda rid, tid: tid == tenant)
    return {
        "tenant_id": tenant,
        "exposed": bool(responses),
        "my_requests_read": sorted(read),
        "reading_responses": len(responses),
        "reading_tenants": len(tenants - {tenant}),
        "pages": len(pages),
        "same_tenant_responses": len(own_responses),
        "same_tenant_pages": len(own_pages),
        "my_requests_read_by_own_responses": sorted(own_read),
    }


def request_status(findings: pl.DataFrame, request_id: str, tenant: str | None) -> dict:
    """One request's part in the window's findings: what it read that it did not own, and who read its data
    (counts only). ``tenant``: the request's tenant; another tenant's request of the same id is not this one,
    neither as reader nor as victim."""
    own = findings.filter(pl.col("code").is_in(sorted(AFFECTED_CODES)) & (pl.col("request_id") == request_id))
    if tenant is not None:
        own = own.filter(pl.col("tenant_id") == tenant)
    codes: set[str] = set()
    pages: set[tuple] = set()
    victims: set[str] = set()
    victim_tenants: set[str] = set()
    for f in own.iter_rows(named=True):
        codes.add(f["code"])
        pages.update((f["node"], p) for p in f["pages"] or ())
        victims.update(v for v in f["victim_request_ids"] or () if v)
        victim_tenants.update(t for t in f["victim_tenant_ids"] or () if t)
    responses, tenants, _, _ = _reads_of(
        findings, lambda rid, tid: rid == request_id and (tenant is None or tid == tenant)
    )
    me = tenant if tenant is not None else next(iter(own["tenant_id"].to_list()), None)
    return {
        "request_id": request_id,
        "affected": bool(codes),
        "codes": sorted(codes, key=lambda c: int(c[1:])),
        "pages_read_foreign": len(pages),
        "other_requests": len(victims - {request_id}),
        "other_tenants": len({t for t in victim_tenants if t != me and t not in PSEUDO_VICTIMS}),
        "read_by_responses": len(responses - {request_id}),
        "read_by_tenants": len(tenants - {me, None}),
    }


class _Pseudonyms:
    """Stable stand-ins for another tenant's request and tenant ids and for node names, within one answer."""

    def __init__(self, request_id: str, tenant: str, shared: bool):
        self.me, self.tenant, self.shared = request_id, tenant, shared
        self._names: dict[tuple[str, str], str] = {}

    def _alias(self, kind: str, value: str) -> str:
        key = (kind, value)
        if key not in self._names:
            self._names[key] = f"{kind} {1 + sum(k == kind for k, _ in self._names)}"
        return self._names[key]

    def request(self, rid: str | None, tid: str | None = None) -> str | None:
        """``rid`` itself for the asking request (its id and tenant; no tenant named: only while no other
        tenant's request shares the id), else a pseudonym."""
        mine = rid == self.me and (tid == self.tenant or (tid is None and not self.shared))
        return rid if rid is None or mine else self._alias("other request", rid)

    def other_request(self, rid: str) -> str:
        return self._alias("other request", rid)

    def tenant_id(self, tid: str | None) -> str | None:
        if tid is None or tid == self.tenant or tid in PSEUDO_VICTIMS:
            return tid
        return self._alias("other tenant", tid)

    def node(self, name: str | None) -> str | None:
        return None if name is None else self._alias("node", name)


def tenant_request_pages(doc: dict, tenant: str, shared: bool = False) -> dict:
    """A request drill-down (``answers.pages.detail_document``) as its tenant may see it: other requests,
    tenants and every node as pseudonyms, no evidence event ids and no finding's free text. ``shared``: another
    tenant's request has the same id (then only rows naming this tenant are this request's)."""
    p = _Pseudonyms(doc["request_id"], tenant, shared)

    def owner(row: dict, rid: str = "request_id", tid: str = "tenant_id") -> dict:
        return {**row, "node": p.node(row["node"]), rid: p.request(row[rid], row[tid]), tid: p.tenant_id(row[tid])}

    spans = []
    for s in doc["spans"]:
        s = owner(s)
        mine = s["request_id"] == p.me
        s["holder"] = f"this request ({tenant})" if mine else f"{s['request_id'] or '?'} ({s['tenant_id'] or '?'})"
        spans.append(s)
    pages = [
        {
            **owner(row, "last_writer", "last_writer_tenant"),
            # never the request itself (pages.py): the same id is another tenant's request
            "next_holder": None if row["next_holder"] is None else p.other_request(row["next_holder"]),
        }
        for row in doc["pages"]
    ]
    findings = [
        {
            **owner(f),
            "victim_request_ids": [
                p.request(r, t) for r, t in zip(f["victim_request_ids"] or (), f["victim_tenant_ids"] or ())
            ],
            "victim_tenant_ids": [p.tenant_id(t) for t in f["victim_tenant_ids"] or ()],
            "evidence": None,
            "detail": None,
        }
        for f in doc["findings"]
    ]
    response = doc["response"]
    if response is not None:
        response = {
            **response,
            "tenant_id": tenant,
            "latency_finding": response["latency_finding"]
            and "TTFT implausible for its prefill node's measured rate (F9)",
        }
    return {
        **doc,
        "tenant_id": tenant,
        "spans": spans,
        "marks": [owner(m) for m in doc["marks"]],
        "pages": pages,
        "transfers": [{**t, "node": p.node(t["node"])} for t in doc["transfers"]],
        "response": response,
        "findings": findings,
    }
