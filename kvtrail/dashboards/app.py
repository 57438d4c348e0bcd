"""The Streamlit script ``kvtrail dashboard`` runs: source, the shared filter, one view, the error pages.

The source comes from the environment the command sets (``KVTRAIL_DASHBOARD_DB``, or ``..._URL`` with
``..._TOKEN``; a token never appears on a command line). The view, window and filters live in the page's
query parameters, so a link (``?view=Affected+responses&request=r17``) opens the same picture.
"""

from __future__ import annotations

import os

import streamlit as st

from kvtrail import forensics as fx
from kvtrail.answers.store import SourceError, StoreSource
from kvtrail.dashboards import (
    affected_view,
    exposure_view,
    findings_view,
    fleet_view,
    report_view,
    transfers_view,
)
from kvtrail.dashboards.filters import sidebar_window
from kvtrail.dashboards.launch import ENV_DB, ENV_TOKEN, ENV_URL
from kvtrail.errors import KvtrailError

VIEWS = {
    "Fleet": fleet_view.render,
    "Findings": findings_view.render,
    "Affected responses": affected_view.render,
    "Exposure": exposure_view.render,
    "Transfers": transfers_view.render,
    "Report": report_view.render,
}
TENANT_VIEWS = ("Affected responses", "Exposure")
REFRESH_S = (5, 10, 30, 60, 300)


@st.cache_resource(show_spinner=False)
def _source(db: str | None, url: str | None, token: str | None):
    if url:
        from kvtrail.answers.remote import RemoteSource

        return RemoteSource(url, token)
    if not db:
        raise SourceError("missing", "no store given: start the dashboard with --db PATH or --url URL --token T")
    return StoreSource(db)


def error_page(exc: SourceError) -> None:
    """One page that says what is wrong with the store and what to do."""
    st.title("kvtrail dashboard")
    what = {
        "missing": ("Store not found", "Point --db at a kvtrail store (e.g. one written by `kvtrail simulate`)."),
        "locked": (
            "Store locked by a writer",
            "Another process (the kvtrail service, an ingest) holds the store. "
            "Read it through the running service instead: `kvtrail dashboard --url URL --token T`.",
        ),
        "newer": (
            "Store of another format",
            "This kvtrail cannot read the store's format; a store written by a "
            "newer kvtrail needs that kvtrail's dashboard.",
        ),
        "invalid": ("Store cannot be read", ""),
    }
    title, hint = what.get(exc.kind, what["invalid"])
    st.error(f"**{title}.** {exc}", icon=":material/error:")
    if hint:
        st.markdown(hint)


def main() -> None:
    st.set_page_config(page_title="kvtrail", page_icon=":material/memory:", layout="wide")
    try:
        src = _source(os.environ.get(ENV_DB), os.environ.get(ENV_URL), os.environ.get(ENV_TOKEN))
    except SourceError as exc:
        error_page(exc)
        return
    except KvtrailError as exc:
        error_page(SourceError("invalid", str(exc)))
        return
    names = list(TENANT_VIEWS if src.role == "tenant" else VIEWS)
    asked = st.query_params.get("view")
    st.sidebar.title("kvtrail")
    st.sidebar.caption(src.label)
    view = st.sidebar.radio("view", names, index=names.index(asked) if asked in names else 0, key="view")
    try:
        w = sidebar_window(src)
        every = None
        if st.sidebar.toggle("auto-refresh", value=False, key="refresh"):
            every = st.sidebar.selectbox("every (s)", REFRESH_S, index=1, key="refresh-s")
        st.query_params["view"] = view
        if w is None:
            return
        st.fragment(run_every=every)(_render)(src, view, w)
    except SourceError as exc:
        error_page(exc)


def _render(src, view: str, w: fx.Window) -> None:
    try:
        VIEWS[view](src.rendering(), w)
    except SourceError as exc:
        error_page(exc)
    except KvtrailError as exc:  # a bad filter value: named by the forensics API, shown, not raised
        st.error(str(exc))


main()
