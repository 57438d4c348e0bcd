"""Findings over time by code and node, counts and severities, and the findings table with evidence."""

from __future__ import annotations

import polars as pl
import streamlit as st

from kvtrail import forensics as fx
from kvtrail.answers.tally import findings_tally
from kvtrail.dashboards import widgets
from kvtrail.report import charts

COLUMNS = [
    "code",
    "title",
    "severity",
    "node",
    "request_id",
    "tenant_id",
    "victim_tenant_ids",
    "pages",
    "first_ns",
    "last_ns",
    "evidence",
    "detail",
]


def render(src, w: fx.Window) -> None:
    st.header("Findings over time")
    widgets.coverage(src.coverage(w))
    found = src.findings(w)
    tally, counted = findings_tally(src, w, found)
    st.caption(f"source: {src.found(w)[1]}; {counted}")
    if found.is_empty():
        widgets.empty("No findings in this window.")
        return
    sev = tally.group_by("severity").len()
    by = dict(zip(sev["severity"], sev["len"]))
    c = st.columns(4)
    c[0].metric("findings", len(tally))
    for col, name in zip(c[1:], ("critical", "high", "medium")):
        col.metric(name, int(by.get(name, 0)))
    stack = st.radio("stack by", ["code", "node"], horizontal=True, key="findings-stack")
    if charts.available():
        widgets.chart(charts.findings_over_time(tally, by=stack), "findings-chart")
    counts = (
        tally.group_by("code", "title", "severity")
        .agg(pl.len().alias("findings"), pl.col("node").n_unique().alias("nodes"))
        .with_columns(pl.col("code").str.slice(1).cast(pl.Int32).alias("_n"))
        .sort("_n")
        .drop("_n")
    )
    st.subheader("Counts by code")
    widgets.table(counts, key="findings-counts")
    st.subheader("Findings with evidence event ids (producer:seq)")
    codes = st.multiselect("codes", counts["code"].to_list(), key="findings-codes")
    shown = found.filter(pl.col("code").is_in(codes)) if codes else found
    widgets.table(shown.sort("last_ns"), key="findings-table", columns=COLUMNS)
