"""Transfers: length (F2) and digest (F3) mismatches over time per node pair."""

from __future__ import annotations

import streamlit as st

from kvtrail import forensics as fx
from kvtrail.dashboards import widgets
from kvtrail.forensics import charts


def render(src, w: fx.Window) -> None:
    st.header("Transfers")
    rows = src.transfers(w)
    c = st.columns(3)
    c[0].metric("length mismatches (F2)", int((rows["code"] == "F2").sum()))
    c[1].metric("digest mismatches (F3)", int((rows["code"] == "F3").sum()))
    c[2].metric("node pairs", rows["pair"].n_unique())
    if rows.is_empty():
        widgets.empty("No transfer mismatches in this window: what decode reserved, prefill sent and landed agree.")
        return
    if charts.available():
        widgets.chart(charts.transfers_over_time(rows), "transfers-chart")
    widgets.table(rows, key="transfers-table")
