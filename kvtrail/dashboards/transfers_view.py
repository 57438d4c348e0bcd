"""Transfers: length (F2) and digest (F3) mismatches over time per node pair, beside how many transfers
landed in the window (the per-minute aggregates where they cover it)."""

from __future__ import annotations

import polars as pl
import streamlit as st

from kvtrail import forensics as fx
from kvtrail.dashboards import widgets
from kvtrail.report import charts


def render(src, w: fx.Window) -> None:
    st.header("Transfers")
    rows = src.transfers(w)
    counts = src.counts(w)
    c = st.columns(5)
    c[0].metric("length mismatches (F2)", int((rows["code"] == "F2").sum()))
    c[1].metric("digest mismatches (F3)", int((rows["code"] == "F3").sum()))
    c[2].metric("node pairs", rows["pair"].n_unique())
    if counts is not None and w.tenant is None:  # the counters are per node: no tenant split
        ev = counts.events if w.node is None else counts.events.filter(pl.col("node") == w.node)
        c[3].metric("transfers received", int(ev["transfers_received"].sum()))
        c[4].metric("received not ok", int(ev["transfers_not_ok"].sum()))
        st.caption(f"transfers received: {counts.describe()}")
    if rows.is_empty():
        widgets.empty("No transfer mismatches in this window: what decode reserved, prefill sent and landed agree.")
        return
    if charts.available():
        widgets.chart(charts.transfers_over_time(rows), "transfers-chart")
    widgets.table(rows, key="transfers-table")
