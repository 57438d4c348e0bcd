"""One request's drill-down: the page ownership timeline of every page it read, and what it was sent.

For each page the request read, on the node where it read it: who held the page (allocation to free),
who wrote it, when it was freed and given to someone else, and the request's own reads. The history is
read from the events of that node in a bounded span around the request (``LOOKBACK_NS`` before its first
event there, ``AFTER_NS`` after its last read of the pages shown), for at most ``MAX_PAGES`` pages, the
foreign ones (its F1/F5 findings) first. Beside it: what decode reserved, prefill sent and decode received
(tokens, pages, digests; a bootstrap room's sends under prefill's own request id too), and the response's TTFT.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import polars as pl

from kvtrail import forensics as fx
from kvtrail.forensics.questions import findings_frame
from kvtrail.forensics.transfer_events import request_transfers

LOOKBACK_NS = 120 * 10**9  # the page history shown before the request's first event on the node
AFTER_NS = 10**9  # and after its last read of them: when they were freed and reallocated
MAX_PAGES = 24  # rows of the chart; the text above it says how many pages there were
_ORDER = {"pages_allocated": 0, "kv_written": 1, "kv_read": 2, "pages_freed": 3}
SPAN_SCHEMA = {
    "node": pl.Utf8,
    "page": pl.Int64,
    "holder": pl.Utf8,
    "request_id": pl.Utf8,
    "tenant_id": pl.Utf8,
    "start_ns": pl.Int64,
    "end_ns": pl.Int64,
}
MARK_SCHEMA = {
    "node": pl.Utf8,
    "page": pl.Int64,
    "what": pl.Utf8,
    "request_id": pl.Utf8,
    "tenant_id": pl.Utf8,
    "wall_ns": pl.Int64,
}
TRANSFER_SCHEMA = {
    "kind": pl.Utf8,
    "node": pl.Utf8,
    "wall_ns": pl.Int64,
    "transfer_id": pl.UInt64,
    "num_tokens": pl.Int64,
    "num_pages": pl.Int32,
    "digest": pl.UInt64,
    "digest_algo": pl.Utf8,
    "status": pl.Utf8,
}


@dataclass(frozen=True)
class RequestDetail:
    """Everything the drill-down shows about one request."""

    request_id: str
    tenant_id: str | None
    spans: pl.DataFrame  # who held each page when (SPAN_SCHEMA)
    marks: pl.DataFrame  # writes, this request's reads, frees (MARK_SCHEMA)
    pages: pl.DataFrame  # per page read: foreign?, last writer before the read, freed, reallocated
    pages_read: int  # every page it read (the chart shows at most MAX_PAGES)
    transfers: pl.DataFrame  # reserved / sent / received: tokens, pages, digest, status
    response: dict | None  # http_status, prompt/completion tokens, ttft, latency, implied prefill rate
    findings: pl.DataFrame  # its findings with evidence


@dataclass(frozen=True)
class RequestKey:
    """What the store numbers a request by: its tenant, its id and its own first event (producer, seq, time).
    Clients may choose request ids, so two tenants' requests can share one; the id text alone names neither."""

    tenant_id: str
    request_id: str
    first_producer: str
    first_seq: int
    first_ns: int


def request_keys(con: duckdb.DuckDBPyConnection, request_id: str, tenant_id: str | None = None) -> list[RequestKey]:
    """The requests named ``request_id`` (of ``tenant_id`` only, when given), first-seen first. A request is
    known by the events naming its tenant; events of the id that name no tenant belong to none of several."""
    rows = con.execute(
        "SELECT tenant_id, arg_min(producer_id, (wall_ns, producer_id, seq)),"
        " arg_min(seq, (wall_ns, producer_id, seq)), min(wall_ns) FROM events_v"
        " WHERE request_id = ? AND tenant_id IS NOT NULL AND (? IS NULL OR tenant_id = ?)"
        " GROUP BY tenant_id ORDER BY 4, 1",
        [request_id, tenant_id, tenant_id],
    ).fetchall()
    return [RequestKey(t, request_id, str(p), int(q), int(ns)) for t, p, q, ns in rows]


def request_owner(con: duckdb.DuckDBPyConnection, request_id: str, tenant_id: str | None) -> str | None:
    """The tenant of ``request_id``, if it has one (and, for a tenant asking, it is that tenant); else None."""
    keys = request_keys(con, request_id, tenant_id)
    return keys[0].tenant_id if keys else None


def _shared(con: duckdb.DuckDBPyConnection, request_id: str) -> bool:
    return len(request_keys(con, request_id)) > 1


def request_detail(
    con: duckdb.DuckDBPyConnection, request_id: str, found: list[fx.Finding], tenant: str | None = None
) -> RequestDetail:
    """The drill-down of ``request_id`` (``found``: its findings in the window); of ``tenant``'s request of that
    id when another tenant's request shares it (then the events naming no tenant are neither's)."""
    only = tenant if tenant is not None and _shared(con, request_id) else None
    me = (request_id, only)
    # Page lists live run-length encoded in page_runs (list 0: an event's ``pages``).
    reads = con.execute(
        """
        SELECT e.node, e.wall_ns, g.page, e.tenant_id FROM events_v e
        JOIN page_runs r ON r.producer_id = e.producer_id AND r.seq = e.seq AND r.list = 0,
             generate_series(r.page_start, r.page_start::BIGINT + r.num_pages - 1) AS g(page)
        WHERE e.kind = 'kv_read' AND e.request_id = ? AND (? IS NULL OR e.tenant_id = ?) ORDER BY e.wall_ns""",
        [request_id, only, only],
    ).fetchall()
    foreign = {(f.node, p) for f in found if f.code in fx.AFFECTED_CODES for p in f.pages}
    read_pages: dict[tuple[str, int], int] = {}
    for node, t, page, _ in reads:
        read_pages.setdefault((node, int(page)), t)
    focus = sorted(read_pages, key=lambda k: (k not in foreign, k[0], k[1]))[:MAX_PAGES]
    spans: list[dict] = []
    marks: list[dict] = []
    for node in sorted({n for n, _ in focus}):
        wanted = sorted(p for n, p in focus if n == node)
        lo = con.execute(
            "SELECT min(wall_ns) FROM events_v WHERE request_id = ? AND node = ? AND (? IS NULL OR tenant_id = ?)",
            [request_id, node, only, only],
        ).fetchall()[0][0]
        if lo is None:
            continue
        # up to its last read of these pages: what happened to them after that is another request's story
        hi = max(read_pages[(node, p)] for p in wanted)
        rows = con.execute(
            """
            SELECT e.kind, e.request_id, e.tenant_id, e.wall_ns, e.seq, g.page FROM events_v e
            JOIN page_runs r ON r.producer_id = e.producer_id AND r.seq = e.seq AND r.list = 0
                 AND r.page_start <= ? AND r.page_start::BIGINT + r.num_pages > ?,
                 generate_series(r.page_start, r.page_start::BIGINT + r.num_pages - 1) AS g(page)
            WHERE e.node = ? AND e.kind IN ('pages_allocated', 'pages_freed', 'kv_written', 'kv_read')
              AND e.wall_ns BETWEEN ? AND ? AND list_contains(?::INTEGER[], g.page::INTEGER)""",
            [max(wanted), min(wanted), node, lo - LOOKBACK_NS, hi + AFTER_NS, wanted],
        ).fetchall()
        _history(node, rows, me, hi + AFTER_NS, spans, marks)
    owner = only if only is not None else reads[0][3] if reads else None
    spans_df = pl.DataFrame(spans, schema=SPAN_SCHEMA)
    marks_df = pl.DataFrame(marks, schema=MARK_SCHEMA)
    page_rows = [
        _page_row(node, page, read_pages[(node, page)], (node, page) in foreign, marks_df, me) for node, page in focus
    ]
    return RequestDetail(
        request_id,
        owner,
        spans_df,
        marks_df,
        pl.DataFrame(page_rows, schema=_PAGE_SCHEMA),
        len(read_pages),
        _transfers(con, request_id, only),
        _response(con, request_id, found, only),
        findings_frame(found),
    )


def detail_document(d: RequestDetail) -> dict:
    """The drill-down as JSON-able rows: what the service's ``GET /v1/requests/{id}/pages`` sends."""
    return {
        "request_id": d.request_id,
        "tenant_id": d.tenant_id,
        "pages_read": d.pages_read,
        "spans": d.spans.to_dicts(),
        "marks": d.marks.to_dicts(),
        "pages": d.pages.to_dicts(),
        "transfers": d.transfers.to_dicts(),
        "response": d.response,
        "findings": d.findings.to_dicts(),
    }


def detail_from_document(doc: dict) -> RequestDetail:
    """The drill-down back from :func:`detail_document`'s JSON, with the local frames' column types."""
    return RequestDetail(
        doc["request_id"],
        doc.get("tenant_id"),
        pl.DataFrame(doc["spans"], schema=SPAN_SCHEMA),
        pl.DataFrame(doc["marks"], schema=MARK_SCHEMA),
        pl.DataFrame(doc["pages"], schema=_PAGE_SCHEMA),
        int(doc["pages_read"]),
        pl.DataFrame(doc["transfers"], schema=TRANSFER_SCHEMA),
        doc.get("response"),
        pl.DataFrame(doc["findings"], schema=findings_frame([]).schema),
    )


Me = tuple[str, str | None]  # the request shown: its id, and its tenant when another tenant's request shares the id


def _is_me(rid: str | None, tenant: str | None, me: Me) -> bool:
    return rid == me[0] and (me[1] is None or tenant == me[1])


def _label(rid: str | None, tenant: str | None, me: Me) -> str:
    if _is_me(rid, tenant, me):
        return f"this request ({tenant})"
    return f"{(rid or '?')[:12]} ({tenant or '?'})"


def _history(node: str, rows: list[tuple], me: Me, end_ns: int, spans: list[dict], marks: list[dict]) -> None:
    """Holding spans (allocation to free) and marks of each page, from its events in time order."""
    open_by_page: dict[int, dict] = {}
    for kind, rid, tenant, t, _seq, page in sorted(rows, key=lambda r: (r[5], r[3], _ORDER[r[0]], r[4])):
        page = int(page)
        if kind == "pages_allocated":
            if page in open_by_page:  # handed out while held (F6): both holders show
                spans.append({**open_by_page.pop(page), "end_ns": t})
            open_by_page[page] = {
                "node": node,
                "page": page,
                "holder": _label(rid, tenant, me),
                "request_id": rid,
                "tenant_id": tenant,
                "start_ns": t,
            }
        elif kind == "pages_freed":
            if page in open_by_page:
                spans.append({**open_by_page.pop(page), "end_ns": t})
            marks.append(
                {"node": node, "page": page, "what": "free", "request_id": rid, "tenant_id": tenant, "wall_ns": t}
            )
        elif kind == "kv_written":
            marks.append(
                {"node": node, "page": page, "what": "write", "request_id": rid, "tenant_id": tenant, "wall_ns": t}
            )
        elif _is_me(rid, tenant, me):
            marks.append(
                {"node": node, "page": page, "what": "read", "request_id": rid, "tenant_id": tenant, "wall_ns": t}
            )
    spans.extend({**s, "end_ns": end_ns} for s in open_by_page.values())


_PAGE_SCHEMA = {
    "node": pl.Utf8,
    "page": pl.Int64,
    "foreign": pl.Boolean,
    "read_ns": pl.Int64,
    "last_writer": pl.Utf8,
    "last_writer_tenant": pl.Utf8,
    "last_written_ns": pl.Int64,
    "freed_after_read_ns": pl.Int64,
    "next_holder": pl.Utf8,
}


def _page_row(node: str, page: int, read_ns: int, is_foreign: bool, marks: pl.DataFrame, me: Me) -> dict:
    m = marks.filter((pl.col("node") == node) & (pl.col("page") == page))
    writes = m.filter((pl.col("what") == "write") & (pl.col("wall_ns") <= read_ns)).sort("wall_ns")
    last = writes.row(-1, named=True) if len(writes) else None
    frees = m.filter((pl.col("what") == "free") & (pl.col("wall_ns") >= read_ns)).sort("wall_ns")
    freed = frees["wall_ns"][0] if len(frees) else None
    mine = pl.col("request_id") == me[0]
    if me[1] is not None:
        mine = mine & (pl.col("tenant_id") == me[1])
    later = m.filter(
        (pl.col("what") == "write") & (pl.col("wall_ns") > (freed or read_ns)) & ~mine.fill_null(False)
    ).sort("wall_ns")
    return {
        "node": node,
        "page": page,
        "foreign": is_foreign,
        "read_ns": read_ns,
        "last_writer": last["request_id"] if last else None,
        "last_writer_tenant": last["tenant_id"] if last else None,
        "last_written_ns": last["wall_ns"] if last else None,
        "freed_after_read_ns": freed,
        "next_holder": later["request_id"][0] if len(later) else None,
    }


def _transfers(con: duckdb.DuckDBPyConnection, request_id: str, only: str | None) -> pl.DataFrame:
    return pl.DataFrame(request_transfers(con, request_id, only)).cast(pl.Schema(TRANSFER_SCHEMA))


def _response(
    con: duckdb.DuckDBPyConnection, request_id: str, found: list[fx.Finding], only: str | None
) -> dict | None:
    rows = con.execute(
        "SELECT http_status, prompt_tokens, completion_tokens, ttft_ns, latency_ns, tenant_id "
        "FROM events_v WHERE kind = 'response_sent' AND request_id = ? AND (? IS NULL OR tenant_id = ?) "
        "ORDER BY wall_ns DESC LIMIT 1",
        [request_id, only, only],
    ).fetchall()
    if not rows:
        return None
    status, prompt, completion, ttft, latency, tenant = rows[0]
    rate = prompt / (ttft / 1e9) if prompt and ttft else None
    f9 = [f.detail for f in found if f.code == "F9"]
    return {
        "http_status": status,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "ttft_ns": ttft,
        "latency_ns": latency,
        "tenant_id": tenant,
        "implied_prefill_tokens_per_s": rate,
        "latency_finding": f9[0] if f9 else None,
    }
