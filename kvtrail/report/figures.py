"""The report's pictures: the charts the dashboard shows (``kvtrail.report.charts``), as PNG blocks.

A figure block is ``("img", png_bytes, caption)``; ``render`` embeds it in the HTML (a data URI, so the
page stays self-contained) and the PDF, and names it in the Markdown. Without the ``dashboard`` extra
(Altair, vl-convert) the report says once that its figures were left out; the tables carry the same
numbers either way.
"""

from __future__ import annotations

import polars as pl

from kvtrail.forensics.findings import AFFECTED_CODES
from kvtrail.report import charts

LEFT_OUT = (
    "Figures left out: drawing them needs the 'dashboard' extra (Altair and vl-convert-python); "
    "the tables hold the same numbers."
)


def _figure(make, frame: pl.DataFrame, caption: str) -> list[tuple]:
    if frame.is_empty() or not charts.available():
        return []
    return [("img", charts.png(make(frame)), caption)]


def note(r) -> list[tuple]:
    """The one line saying figures were left out (only when they would have been drawn)."""
    if charts.available() or (r.capacity.is_empty() and r.findings.is_empty()):
        return []
    return [("p", LEFT_OUT)]


def pool_vs_context(r) -> list[tuple]:
    return _figure(
        charts.pool_vs_context,
        r.capacity,
        "Figure: KV pool vs advertised context per node configuration (red: pool below context, with the shortfall).",
    )


def timeline(r) -> list[tuple]:
    f = r.findings
    shown = (
        f.filter(
            ~pl.col("code").is_in(sorted(AFFECTED_CODES)) | pl.col("request_id").is_in(list(r.affected["request_id"]))
        )
        if len(f)
        else f
    )
    return _figure(
        charts.foreign_reads_timeline,
        shown,
        "Figure: UTC timeline of the window's foreign reads (F1, F5; red) and other findings.",
    )


def exposure(r) -> list[tuple]:
    return _figure(
        charts.exposure_heatmap,
        r.matrix,
        "Figure: exposure heatmap, recipient tenant x victim tenant (label: responses; colour: pages). "
        "Where the two are the same tenant, its responses read another of its own requests; "
        "'(never written)': stale or uninitialised memory, no customer's data.",
    )
