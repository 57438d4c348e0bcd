"""The charts of kvtrail's two faces: Altair (Vega-Lite) specs the dashboard renders live and the
disclosure report renders to PNG (``vl-convert-python``, no browser).

Each function takes the frame a forensics question returns (Polars) and gives one ``alt.Chart``; they
read only the columns named in their docstrings, so the dashboard and the report draw the same picture
of the same numbers. Altair and vl-convert come with the ``dashboard`` extra: :func:`available` tells a
base install (whose report then says the charts were left out) from one that can draw.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import polars as pl

from kvtrail.forensics.findings import CODES

SHORT = "#c62828"  # a node whose pool is below its context: the colour of the incident
COVERED = "#2e7d32"
CONTEXT = "#1a1a1a"
WIDTH_PX = 640


def available() -> bool:
    """Whether Altair and vl-convert are installed (the ``dashboard`` extra)."""
    return all(importlib.util.find_spec(m) is not None for m in ("altair", "vl_convert"))


def _alt() -> Any:
    import altair as alt

    return alt


def _utc(df: pl.DataFrame, column: str, name: str) -> pl.DataFrame:
    """A ns column as a UTC datetime column for the time axis."""
    return df.with_columns(pl.from_epoch(pl.col(column), time_unit="ns").dt.replace_time_zone("UTC").alias(name))


BELOW, COVERS = "pool below context (F8)", "pool covers context"


def config_labels(capacity: pl.DataFrame) -> list[str]:
    """One label per node configuration row: the node's name, with its instance (and the order of its
    configurations) when it has several. A restarted node is one node over time: each instance's pool is
    its own, so a chart must never stack or sum them under one name."""
    nodes = capacity["node"].to_list()
    instances = capacity["instance"].to_list() if "instance" in capacity.columns else [None] * len(nodes)
    per_node = {n: nodes.count(n) for n in nodes}
    per_instance = {
        (n, i): sum(1 for m, j in zip(nodes, instances) if (m, j) == (n, i)) for n, i in zip(nodes, instances)
    }
    labels, seen = [], dict.fromkeys(zip(nodes, instances), 0)
    for n, i in zip(nodes, instances):
        seen[(n, i)] += 1
        if per_node[n] == 1:
            labels.append(str(n))
        elif per_instance[(n, i)] == 1 and i is not None:
            labels.append(f"{n} ({i})")
        else:
            labels.append(f"{n} ({i or '?'} #{seen[(n, i)]})")
    return labels


def pool_vs_context(capacity: pl.DataFrame) -> Any:
    """KV pool (bars) against advertised context (a black tick) per node configuration, one row each (a
    restarted node's instances on rows of their own); a pool below its context is red and labelled with
    its shortfall. Columns: node, role, pool_tokens, context_tokens, shortfall_tokens; instance if present."""
    alt = _alt()
    df = capacity.select("node", "role", "pool_tokens", "context_tokens", "shortfall_tokens").with_columns(
        pl.Series("configuration", config_labels(capacity), dtype=pl.Utf8),
        pl.when(pl.col("shortfall_tokens") > 0).then(pl.lit(BELOW)).otherwise(pl.lit(COVERS)).alias("status"),
        pl.col("shortfall_tokens")
        .map_elements(lambda n: f"SHORT by {n:,} tokens" if n > 0 else "", return_dtype=pl.Utf8)
        .alias("label"),
    )
    rows = max(1, len(df))
    # Sizes on the layers themselves: a renderer may size a layer chart from its layers alone.
    base = (
        alt.Chart(df.to_pandas())
        .encode(y=alt.Y("configuration:N", title=None, sort=None))
        .properties(width=WIDTH_PX, height=28 * rows)
    )
    colour = alt.Color(
        "status:N",
        title=None,
        scale=alt.Scale(domain=[BELOW, COVERS], range=[SHORT, COVERED]),
        legend=alt.Legend(orient="bottom"),
    )
    bars = base.mark_bar(height=16).encode(
        x=alt.X("pool_tokens:Q", title="tokens"),
        color=colour,
        tooltip=["configuration", "role", "pool_tokens", "context_tokens", "shortfall_tokens"],
    )
    context = base.mark_tick(color=CONTEXT, thickness=3, size=24).encode(x="context_tokens:Q")
    label = base.mark_text(align="left", dx=6, color=SHORT, fontWeight="bold").encode(
        x="context_tokens:Q", text="label:N"
    )
    return (bars + context + label).properties(title="KV pool (bar) vs advertised context (black tick) per node")


def findings_over_time(found: pl.DataFrame, by: str = "code") -> Any:
    """Findings per minute (by their last time), stacked by ``by`` (code or node). Columns: last_ns, code, node."""
    alt = _alt()
    df = _utc(found.select("last_ns", "code", "node"), "last_ns", "time")
    return (
        alt.Chart(df.to_pandas())
        .mark_bar()
        .encode(
            x=alt.X("utcyearmonthdatehoursminutes(time):T", title="time (UTC), per minute"),
            y=alt.Y("count():Q", title="findings"),
            color=alt.Color(f"{by}:N", title=by),
            tooltip=[alt.Tooltip("utcyearmonthdatehoursminutes(time):T", title="minute"), by, "count()"],
        )
        .properties(width=WIDTH_PX, height=220, title=f"Findings over time by {by}")
    )


def foreign_reads_timeline(found: pl.DataFrame) -> Any:
    """A UTC timeline of foreign reads (F1, F5) and the other findings: one point per finding, one row per
    code. Columns: last_ns, code, node, request_id."""
    alt = _alt()
    read, other = "foreign read (F1, F5)", "other finding"
    df = _utc(found.select("last_ns", "code", "node", "request_id"), "last_ns", "time").with_columns(
        pl.when(pl.col("code").is_in(["F1", "F5"])).then(pl.lit(read)).otherwise(pl.lit(other)).alias("kind")
    )
    days = df["time"].dt.date().unique().sort()
    # one day: hours and minutes on the axis, the date in its title (labels with the date collide)
    title, fmt = (f"time (UTC, {days[0]})", "%H:%M") if len(days) == 1 else ("time (UTC)", "%m-%d %H:%M")
    return (
        alt.Chart(df.to_pandas())
        .mark_point(filled=True, size=60)
        .encode(
            x=alt.X("time:T", title=title, axis=alt.Axis(format=fmt, labelOverlap=True)),
            y=alt.Y("code:N", title=None, sort=list(CODES)),
            color=alt.Color(
                "kind:N",
                title=None,
                scale=alt.Scale(domain=[read, other], range=[SHORT, "#607d8b"]),
                legend=alt.Legend(orient="bottom"),
            ),
            tooltip=["code", "node", "request_id", alt.Tooltip("time:T", format="%Y-%m-%d %H:%M:%S")],
        )
        .properties(width=WIDTH_PX, height=180, title="Timeline of foreign reads and other findings (UTC)")
    )


def exposure_heatmap(matrix: pl.DataFrame) -> Any:
    """Recipient tenant x victim tenant, coloured by pages read, labelled with responses. Columns:
    recipient_tenant, victim_tenant, responses, pages."""
    alt = _alt()
    df = matrix.select("recipient_tenant", "victim_tenant", "responses", "pages").to_pandas()
    base = (
        alt.Chart(df)
        .encode(
            x=alt.X("victim_tenant:N", title="victim tenant (whose data)", axis=alt.Axis(labelAngle=-30)),
            y=alt.Y("recipient_tenant:N", title="recipient tenant (who read it)"),
        )
        .properties(
            width=min(WIDTH_PX, 60 * max(1, df["victim_tenant"].nunique()) + 80),
            height=26 * max(1, df["recipient_tenant"].nunique()),
        )
    )
    cells = base.mark_rect().encode(
        color=alt.Color("pages:Q", title="pages read", scale=alt.Scale(scheme="reds")),
        tooltip=["recipient_tenant", "victim_tenant", "responses", "pages"],
    )
    dark = alt.datum.pages > float(df["pages"].max() or 0) / 2
    text = base.mark_text(fontSize=11).encode(
        text=alt.Text("responses:Q"), color=alt.condition(dark, alt.value("white"), alt.value("black"))
    )
    return (cells + text).properties(title="Exposure: responses (label) and pages (colour)")


def threshold_chart(thresholds: pl.DataFrame) -> Any:
    """Affected vs unaffected prompts over and under each prefill node's pool. Columns: node, pool_tokens,
    affected_over_pool, unaffected_over_pool, and affected/unaffected totals when present."""
    alt = _alt()
    rows = []
    for r in thresholds.to_dicts():
        for col, what in (
            ("affected_over_pool", "affected, longer than pool"),
            ("unaffected_over_pool", "unaffected, longer than pool"),
        ):
            if r.get(col) is not None:
                rows.append({"node": f"{r['node']} (pool {r['pool_tokens']:,})", "prompts": r[col], "kind": what})
    df = pl.DataFrame(rows, schema={"node": pl.Utf8, "prompts": pl.Int64, "kind": pl.Utf8}).to_pandas()
    return (
        alt.Chart(df)
        .mark_bar()
        .encode(
            y=alt.Y("node:N", title=None),
            x=alt.X("prompts:Q", title="prompts", axis=alt.Axis(tickMinStep=1)),
            color=alt.Color("kind:N", title=None, scale=alt.Scale(range=[SHORT, "#90a4ae"])),
            yOffset="kind:N",
            tooltip=["node", "kind", "prompts"],
        )
        .properties(
            width=WIDTH_PX, height=36 * max(1, len(df["node"].unique())), title="Prompts longer than the prefill pool"
        )
    )


def transfers_over_time(mismatches: pl.DataFrame) -> Any:
    """Length (F2) and digest (F3) mismatches per minute per node pair. Columns: last_ns, code, pair."""
    alt = _alt()
    df = _utc(mismatches.select("last_ns", "code", "pair"), "last_ns", "time").with_columns(
        pl.format("{} {}", pl.col("code"), pl.col("pair")).alias("mismatch")
    )
    return (
        alt.Chart(df.to_pandas())
        .mark_bar()
        .encode(
            x=alt.X("utcyearmonthdatehoursminutes(time):T", title="time (UTC), per minute"),
            y=alt.Y("count():Q", title="mismatches", axis=alt.Axis(tickMinStep=1)),
            color=alt.Color("mismatch:N", title="code, prefill -> decode"),
            tooltip=["pair", "code", "count()"],
        )
        .properties(width=WIDTH_PX, height=200, title="Transfer mismatches (F2 length, F3 digest) by node pair")
    )


def page_timeline(spans: pl.DataFrame, marks: pl.DataFrame) -> Any:
    """One request's page ownership timeline: per page (rows) who held it (bars from allocation to free,
    coloured by holder), writes (ticks), and the request's reads (red diamonds). ``spans``: page, holder,
    tenant_id, start_ns, end_ns; ``marks``: page, what ("write" / "read" / "free"), request_id, wall_ns."""
    alt = _alt()
    s = _utc(_utc(spans, "start_ns", "start"), "end_ns", "end").to_pandas()
    m = _utc(marks, "wall_ns", "time").to_pandas()
    y = alt.Y("page:O", title="page (node-local id)", sort="ascending")
    pages = max(1, s["page"].nunique() if len(s) else m["page"].nunique() if len(m) else 1)
    size = {"width": WIDTH_PX, "height": min(900, 14 * pages + 40)}
    bars = (
        alt.Chart(s)
        .properties(**size)
        .mark_bar(height=10, opacity=0.75)
        .encode(
            x=alt.X("start:T", title="time (UTC)", axis=alt.Axis(format="%H:%M:%S.%L")),
            x2="end:T",
            y=y,
            color=alt.Color("holder:N", title="held by (request / tenant)"),
            tooltip=[
                "page",
                "holder",
                alt.Tooltip("start:T", format="%H:%M:%S.%L"),
                alt.Tooltip("end:T", format="%H:%M:%S.%L"),
            ],
        )
    )
    shapes = alt.Scale(domain=["write", "read", "free"], range=["square", "diamond", "cross"])
    colours = alt.Scale(domain=["write", "read", "free"], range=["#1a1a1a", SHORT, "#616161"])
    points = (
        alt.Chart(m)
        .properties(**size)
        .mark_point(filled=True, size=70)
        .encode(
            x="time:T",
            y=y,
            shape=alt.Shape("what:N", scale=shapes, title="event"),
            color=alt.Color("what:N", scale=colours, legend=None),
            tooltip=["page", "what", "request_id", alt.Tooltip("time:T", format="%H:%M:%S.%L")],
        )
    )
    return (bars + points).resolve_scale(color="independent").properties(title="Page ownership timeline")


def png(chart: Any, scale: float = 2.0) -> bytes:
    """The chart as PNG bytes (vl-convert: no browser)."""
    import vl_convert as vlc

    return bytes(vlc.vegalite_to_png(chart.to_json(), scale=scale))
