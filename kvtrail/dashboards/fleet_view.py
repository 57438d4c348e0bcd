"""Fleet: every node's KV pool against the context it advertises. A node below its context is the
incident's precondition (F8), so it leads the page in red with its shortfall, before anything else."""

from __future__ import annotations

import polars as pl
import streamlit as st

from kvtrail import forensics as fx
from kvtrail.dashboards import widgets
from kvtrail.report import charts


def render(src, w: fx.Window) -> None:
    st.header("Fleet")
    fleet = src.fleet(w)
    if fleet.is_empty():
        widgets.empty("No node configuration is in effect in this window: no node reported its KV pool.")
        return
    short = fleet.filter(~pl.col("pool_covers_context"))
    if len(short):
        names = "; ".join(
            f"{r['node']} ({r['role']}): pool {r['pool_tokens']:,} < context {r['context_tokens']:,} "
            f"tokens, short by {r['shortfall_tokens']:,}"
            for r in short.iter_rows(named=True)
        )
        st.error(
            f"**{short['node'].n_unique()} node(s) have a KV pool smaller than the context they advertise** "
            f"(F8: prompts longer than the pool can read other requests' pages). {names}",
            icon=":material/warning:",
        )
    else:
        st.success("Every node's KV pool covers the context it advertises.", icon=":material/check_circle:")
    c = st.columns(4)
    c[0].metric("nodes", fleet["node"].n_unique())
    c[1].metric("nodes below context", short["node"].n_unique())
    drops = fleet["recorder_dropped_events"]
    c[2].metric("recorder dropped events", int(drops.sum()) if drops.null_count() < len(drops) else "n/a")
    c[3].metric("unexplained gap events", int(fleet["unexplained_gap_events"].sum()))
    counts = src.counts(w)
    if counts is not None:
        st.caption(f"recorder drops: {counts.describe()}")
    if charts.available():
        widgets.chart(charts.pool_vs_context(fleet), "fleet-chart")
    st.subheader("Node configurations (below context first)")
    flagged = fleet.with_columns((~pl.col("pool_covers_context")).alias("below_context"))
    first = ["node", "role", "below_context", "pool_tokens", "context_tokens", "shortfall_tokens"]
    widgets.table(
        flagged.select(first + [c for c in flagged.columns if c not in first]),
        key="fleet-table",
        alarm="below_context",
        utc_first=False,
    )
    if len(short):
        st.markdown(
            "Which prompts went through these nodes: see **Exposure** (threshold analysis) and **Affected responses**."
        )
