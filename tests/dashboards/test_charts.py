"""The charts module both faces use: specs from the forensics answers, PNGs without a browser, and the
disclosure report's figures in its HTML and PDF."""

from __future__ import annotations

import json
import shutil
import subprocess

import polars as pl
import pytest

from kvtrail import forensics as fx
from kvtrail.answers.store import StoreSource
from kvtrail.cli import main
from kvtrail.forensics.options import ReportOptions
from kvtrail.report import charts
from kvtrail.report.build import build_report
from kvtrail.timeutil import format_utc


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_every_chart_renders_from_the_answers(seeded, window):
    src = StoreSource(seeded)
    fleet = src.fleet(window)
    found = src.findings(window)
    affected = src.affected(window)
    detail = src.request(affected["request_id"][0], window)
    specs = {
        "pool": charts.pool_vs_context(fleet),
        "findings": charts.findings_over_time(found),
        "by-node": charts.findings_over_time(found, by="node"),
        "timeline": charts.foreign_reads_timeline(found),
        "heatmap": charts.exposure_heatmap(src.exposure(window)),
        "thresholds": charts.threshold_chart(src.thresholds(window).table),
        "pages": charts.page_timeline(detail.spans, detail.marks),
    }
    transfers = src.transfers(window)
    if len(transfers):
        specs["transfers"] = charts.transfers_over_time(transfers)
    for name, spec in specs.items():
        w, h = _png_size(charts.png(spec))
        assert w > 300 and h > 100, name


def test_pool_chart_marks_the_nodes_below_their_context(seeded, window):
    fleet = StoreSource(seeded).fleet(window)
    spec = charts.pool_vs_context(fleet).to_dict()
    rows = next(iter(spec["datasets"].values()))
    short = {r["node"]: r["label"] for r in rows if r["status"] == charts.BELOW}
    assert short == {"prefill-0": "SHORT by 200,000 tokens", "prefill-1": "SHORT by 200,000 tokens"}
    assert charts.SHORT in json.dumps(spec)


def test_report_html_and_pdf_carry_the_figures(seeded, window, tmp_path):
    out = tmp_path / "report"
    assert (
        main(
            [
                "forensics",
                "report",
                "--db",
                str(seeded),
                "--from",
                format_utc(window.from_ns),
                "--to",
                format_utc(window.to_ns),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    html = (out / "report.html").read_text()
    assert html.count('<img src="data:image/png;base64,') == 3
    for caption in ("KV pool vs advertised context", "UTC timeline of the window", "exposure heatmap"):
        assert caption in html and caption in (out / "report.md").read_text()
    pdf = (out / "report.pdf").read_bytes()
    assert pdf.count(b"/Subtype /Image") >= 3
    if shutil.which("pdftotext"):
        text = subprocess.run(
            ["pdftotext", str(out / "report.pdf"), "-"], capture_output=True, text=True, check=True
        ).stdout
        assert "Figure: KV pool vs advertised context per node configuration" in text
    assert main(["forensics", "verify-report", str(out), "--db", str(seeded)]) == 0


def test_report_without_the_charts_extra_says_so(monkeypatch, seeded, window):
    from kvtrail.report import figures

    monkeypatch.setattr(charts, "available", lambda: False)
    con = fx.open_store(seeded)
    try:
        r = build_report(con, ReportOptions(window.from_ns, window.to_ns))
    finally:
        con.close()
    assert figures.note(r) == [("p", figures.LEFT_OUT)]
    assert figures.pool_vs_context(r) == [] and figures.exposure(r) == []


@pytest.mark.parametrize("empty", [True, False])
def test_figures_skip_empty_frames(empty):
    df = pl.DataFrame(
        schema={"recipient_tenant": pl.Utf8, "victim_tenant": pl.Utf8, "responses": pl.Int64, "pages": pl.Int64}
    )
    if not empty:
        df = pl.DataFrame({"recipient_tenant": ["a"], "victim_tenant": ["b"], "responses": [1], "pages": [3]})
    from kvtrail.report.figures import _figure

    assert (_figure(charts.exposure_heatmap, df, "x") == []) is empty
