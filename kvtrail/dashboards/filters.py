"""The shared filter every view reads: a UTC window and optional node and tenant, in the sidebar and the
page's query parameters (so a link carries them). Defaults: the store's whole span, every node and tenant."""

from __future__ import annotations

import streamlit as st

from kvtrail import forensics as fx
from kvtrail.dashboards import widgets
from kvtrail.errors import KvtrailError
from kvtrail.timeutil import format_utc, parse_utc

ALL = "(all)"


def _choice(label: str, options: list[str], key: str) -> str | None:
    choices = [ALL] + options
    asked = st.query_params.get(key)
    picked = st.sidebar.selectbox(label, choices, index=choices.index(asked) if asked in choices else 0, key=key)
    if picked == ALL:
        st.query_params.pop(key, None)
        return None
    st.query_params[key] = picked
    return picked


def _time(label: str, key: str, default: int | None) -> int | None:
    initial = st.query_params.get(key) or (format_utc(default) if default is not None else "")
    text = st.sidebar.text_input(label, value=initial, key=key).strip()
    if not text:
        st.query_params.pop(key, None)
        return None
    value = parse_utc(text, field=label)
    st.query_params[key] = text
    return value


def sidebar_window(src) -> fx.Window | None:
    """The window the sidebar selects, or None after showing why there is nothing to show."""
    bounds = src.bounds()
    if bounds is None:
        widgets.empty(
            "The store holds no audit events yet: nothing to show. Record traffic (or run "
            "`kvtrail simulate`) and reload."
        )
        return None
    st.sidebar.subheader("window (UTC)")
    try:
        from_ns = _time("from", "from", bounds[0])
        to_ns = _time("to", "to", bounds[1] + 999)  # shown in µs: rounded up, so the last event stays in
    except (KvtrailError, ValueError) as exc:
        st.error(str(exc))
        return None
    nodes, tenants = src.choices()
    node = _choice("node", nodes, "node") if nodes else None
    tenant = _choice("tenant", tenants, "tenant") if tenants else None
    w = fx.Window(from_ns, to_ns, tenant=tenant, node=node)
    if from_ns is not None and to_ns is not None and from_ns > to_ns:
        st.error("from: is after to")
        return None
    if src.events_in(w) == 0:
        widgets.empty(
            f"No audit events in this window. The store holds events from {format_utc(bounds[0])} "
            f"to {format_utc(bounds[1])}."
        )
        return None
    return w
