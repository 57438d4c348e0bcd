"""What every view shows the same way: tables with UTC times beside ns, empty states, charts."""

from __future__ import annotations

from typing import Any

import polars as pl
import streamlit as st

from kvtrail.timeutil import format_utc


def readable(df: pl.DataFrame) -> pl.DataFrame:
    """ns columns as UTC text (``*_utc``) beside the exact numbers; evidence as ``producer:seq`` text."""
    out = df.with_columns(
        [
            pl.col(c).map_elements(format_utc, return_dtype=pl.Utf8).alias(c[:-3] + "_utc")
            for c in df.columns
            if c.endswith("_ns") and df[c].dtype.is_integer()
        ]
    )
    if "evidence" in out.columns:
        out = out.with_columns(
            pl.col("evidence").map_elements(
                lambda ev: ", ".join(f"{e['producer_id']}:{e['seq']}" for e in ev), return_dtype=pl.Utf8
            )
        )
    return out


ALARM_CSS = "background-color: #ffcdd2; color: #b71c1c; font-weight: bold"


def table(
    df: pl.DataFrame,
    *,
    key: str,
    columns: list[str] | None = None,
    height: int | None = None,
    alarm: str | None = None,
    utc_first: bool = True,
) -> None:
    """A table (UTC times shown first), or a plain '(none)' line when it has no rows. ``alarm``: a boolean
    column; rows where it is true are shown red."""
    if df.is_empty():
        st.caption("(none)")
        return
    shown = readable(df.select(columns) if columns else df)
    utc = [c for c in shown.columns if c.endswith("_utc")]
    order = utc + [c for c in shown.columns if c not in utc] if utc_first else shown.columns
    frame = shown.select(order).to_pandas()
    data: Any = frame
    if alarm is not None:
        flags = frame[alarm].tolist()
        data = frame.style.apply(lambda row: [ALARM_CSS if flags[row.name] else ""] * len(row), axis=1)
    st.dataframe(data, key=key, hide_index=True, width="stretch", height=height or "auto")


def chart(spec: Any, key: str) -> None:
    """An Altair chart at the height its spec asks for (plus its title, axis and legend)."""
    d = spec.to_dict()
    inner = d.get("height") or max((layer.get("height", 0) for layer in d.get("layer", ())), default=0)
    if inner:
        st.altair_chart(spec, key=key, width="stretch", height=int(inner) + 150, theme=None)
    else:
        st.altair_chart(spec, key=key, width="stretch", theme=None)


def empty(text: str) -> None:
    """A view's clear empty state."""
    st.info(text, icon=":material/inbox:")


def coverage(lines: list[str]) -> None:
    """What the answers say of the record they could not see, one warning each, above a view's figures."""
    for line in lines:
        st.warning(line, icon=":material/warning:")
