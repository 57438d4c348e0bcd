"""Report: the disclosure report of the selected window (with an uploaded incident.yaml), its archive
to download, and verify-report's verdict."""

from __future__ import annotations

import streamlit as st

from kvtrail import forensics as fx
from kvtrail.dashboards.reporting import report_of
from kvtrail.errors import KvtrailError


def render(src, w: fx.Window) -> None:
    st.header("Disclosure report")
    if src.role == "tenant":
        st.caption("Reports are for operators: a tenant token may not generate one.")
        return
    if w.from_ns is None or w.to_ns is None:
        st.info("A report needs a window with a start and an end.")
        return
    upload = st.file_uploader("incident.yaml (optional)", type=["yaml", "yml"], key="report-context")
    if not st.button("Generate report", key="report-generate", type="primary"):
        st.caption("Writes report.md/.html/.pdf, the CSV/JSON files and report.json for the window in the sidebar.")
        return
    try:
        with st.spinner("building the report"):
            data, counts, verdict = report_of(src, w, upload.getvalue() if upload is not None else None)
    except KvtrailError as exc:
        st.error(str(exc))
        return
    st.session_state["report-result"] = (data, counts, verdict)
    show(data, counts, verdict)


def show(data: bytes, counts: dict, verdict: str) -> None:
    (st.success if verdict.startswith("confirmed") else st.error)(f"verify-report: {verdict}")
    c = st.columns(3)
    c[0].metric("affected responses", counts.get("affected_responses", 0))
    c[1].metric("victim tenants", counts.get("victim_tenants", 0))
    c[2].metric("findings", counts.get("findings", 0))
    st.download_button("Download report (zip)", data, "kvtrail-report.zip", "application/zip", key="report-download")
