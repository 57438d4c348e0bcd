"""Affected responses: which responses read foreign pages in the window (filterable, CSV), and the
drill-down to one request: its page ownership timeline, reserved vs sent vs landed, TTFT."""

from __future__ import annotations

import polars as pl
import streamlit as st

from kvtrail import forensics as fx
from kvtrail.dashboards import widgets
from kvtrail.outputs import csv_frame
from kvtrail.report import charts

COLUMNS = [
    "request_id",
    "tenant_id",
    "victim_tenants",
    "pages_read_foreign",
    "http_status",
    "prompt_tokens",
    "completion_tokens",
    "codes",
    "victim_requests",
    "other_requests",
    "other_tenants",
    "first_ns",
    "last_ns",
]
VICTIM_IDS = ("tenant_id", "victim_tenants")  # a tenant token's rows have counts (other_*) instead


def render(src, w: fx.Window) -> None:
    st.header("Affected responses")
    widgets.coverage(src.coverage(w))
    rows = src.affected(w)
    c = st.columns(3)
    c[0].metric("affected responses", len(rows))
    c[1].metric("served 2xx", int(rows["http_status"].is_between(200, 299).sum()) if len(rows) else 0)
    c[2].metric("pages read foreign", int(rows["pages_read_foreign"].sum()) if len(rows) else 0)
    if rows.is_empty():
        widgets.empty("No affected responses in this window: no response read another request's KV pages.")
        return
    needle = st.text_input("filter (request, tenant or victim tenant contains)", key="affected-filter").strip()
    if needle:
        rows = rows.filter(
            pl.col("request_id").str.contains(needle, literal=True)
            | pl.col("tenant_id").fill_null("").str.contains(needle, literal=True)
            | pl.col("victim_tenants").list.join(",").str.contains(needle, literal=True)
        )
    hidden = VICTIM_IDS if src.role == "tenant" else ()
    widgets.table(rows, key="affected-table", columns=[c for c in COLUMNS if c in rows.columns and c not in hidden])
    st.download_button(
        "Download CSV",
        csv_frame(widgets.readable(rows)).write_csv(),
        "affected_responses.csv",
        "text/csv",
        key="affected-csv",
    )
    st.subheader("Drill down to one request")
    # a request is its tenant and id: two tenants' requests may share an id (clients choose them)
    ids = list(zip(rows["request_id"].to_list(), rows["tenant_id"].to_list()))
    wanted = st.query_params.get("request")
    if ids:
        first = next((i for i, (rid, _) in enumerate(ids) if rid == wanted), 0)
        picked = st.selectbox(
            "request", ids, index=first, format_func=lambda k: f"{k[0]} ({k[1]})", key="affected-request"
        )
        if picked:
            request_detail(src, picked[0], w, picked[1])


def request_detail(src, rid: str, w: fx.Window, tenant: str | None = None) -> None:
    d = src.request(rid, w, tenant)
    st.markdown(
        f"**Request `{rid}`** of tenant `{d.tenant_id}`: read {d.pages_read:,} page(s); "
        f"{int(d.pages['foreign'].sum())} of the {len(d.pages)} shown were foreign."
    )
    if charts.available() and not d.spans.is_empty():
        widgets.chart(
            charts.page_timeline(d.spans.filter(pl.col("page").is_in(d.pages["page"].to_list())), d.marks),
            "page-timeline-chart",
        )
    widgets.table(d.pages, key="page-table")
    st.subheader("Reserved vs sent vs landed")
    widgets.table(d.transfers, key="transfer-detail")
    if d.response:
        r = d.response
        c = st.columns(4)
        c[0].metric("HTTP status", r["http_status"])
        c[1].metric("prompt tokens", f"{r['prompt_tokens']:,}")
        c[2].metric("TTFT (ms)", f"{r['ttft_ns'] / 1e6:,.1f}" if r["ttft_ns"] is not None else "-")
        rate = r["implied_prefill_tokens_per_s"]
        c[3].metric("implied prefill rate (tokens/s)", f"{rate:,.0f}" if rate else "-")
        if r["latency_finding"]:
            st.warning(f"F9 implausible latency: {r['latency_finding']}")
        else:
            st.caption("TTFT is plausible for its prefill node's measured rate (no F9).")
    st.subheader("Its findings")
    widgets.table(
        d.findings,
        key="request-findings",
        columns=["code", "title", "node", "pages", "victim_request_ids", "victim_tenant_ids", "evidence", "detail"]
        if len(d.findings)
        else None,
    )
