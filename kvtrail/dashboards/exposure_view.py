"""Exposure: recipient tenant x victim tenant, the threshold analysis against each node's pool, and the
exploitation assessment per tenant."""

from __future__ import annotations

import streamlit as st

from kvtrail import forensics as fx
from kvtrail.dashboards import widgets
from kvtrail.report import charts


def render(src, w: fx.Window) -> None:
    st.header("Exposure")
    matrix = src.exposure(w)
    c = st.columns(3)
    c[0].metric("recipient tenants", matrix["recipient_tenant"].n_unique())
    c[1].metric(
        "victim tenants",
        matrix.filter(~matrix["victim_tenant"].is_in(list(fx.PSEUDO_VICTIMS)))["victim_tenant"].n_unique(),
    )
    c[2].metric("pages read foreign", int(matrix["pages"].sum()) if len(matrix) else 0)
    if matrix.is_empty():
        widgets.empty("No exposure in this window: no response read another request's pages.")
    else:
        if charts.available():
            widgets.chart(charts.exposure_heatmap(matrix), "exposure-chart")
        widgets.table(matrix, key="exposure-table")
    st.subheader("Threshold analysis")
    th = src.thresholds(w)
    st.markdown(th.sentence)
    if charts.available() and not th.table.is_empty():
        widgets.chart(charts.threshold_chart(th.table), "threshold-chart")
    widgets.table(th.table, key="threshold-table")
    st.subheader("Exploitation assessment")
    if src.role == "tenant":
        st.caption("not available to a tenant token")
        return
    if w.from_ns is None or w.to_ns is None:
        st.caption("needs a window with a start and an end")
        return
    ex = src.exploitation(w)
    out = ex.filter(ex["verdict"] == "stands out") if len(ex) else ex
    st.metric("tenants that stand out", len(out))
    widgets.table(
        ex,
        key="exploitation-table",
        columns=[
            c
            for c in (
                "tenant_id",
                "excluded_by",
                "affected_responses",
                "long_requests",
                "long_per_hour",
                "baseline_long_per_hour",
                "max_long_in_burst",
                "verdict",
                "reason",
            )
            if c in ex.columns
        ],
    )
