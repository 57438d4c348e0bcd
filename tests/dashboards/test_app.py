"""Every view driven by Streamlit's AppTest on a seeded store: the numbers shown equal the forensics API's
for the same window and filters; empty states and error pages."""

from __future__ import annotations

import io
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import duckdb
import polars as pl
import pytest
from streamlit.testing.v1 import AppTest

from kvtrail import forensics as fx
from kvtrail.audit.store import AuditStore
from kvtrail.forensics.options import ReportOptions
from kvtrail.timeutil import format_utc, parse_utc
from tests.dashboards.conftest import APP

TIMEOUT_S = 120  # a cold replay on a loaded 2-core machine


def run_app(monkeypatch, db: Path | str, view: str, **params: str) -> AppTest:
    monkeypatch.setenv("KVTRAIL_DASHBOARD_DB", str(db))
    monkeypatch.delenv("KVTRAIL_DASHBOARD_URL", raising=False)
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S)
    at.query_params["view"] = view
    for k, v in params.items():
        at.query_params[k] = v
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def metric(at: AppTest, label: str) -> str:
    found = [m.value for m in at.metric if m.label == label]
    assert found, f"no metric {label!r}: {[m.label for m in at.metric]}"
    return found[0].replace(",", "")


TABLES = {  # the columns that tell a view's tables apart (AppTest does not expose a table's key)
    "fleet-table": {"shortfall_tokens", "engine_version"},
    "findings-counts": {"findings", "nodes"},
    "findings-table": {"evidence", "victim_tenant_ids"},
    "affected-table": {"pages_read_foreign", "victim_requests"},
    "exposure-table": {"recipient_tenant", "victim_tenant"},
    "exploitation-table": {"verdict", "long_requests"},
    "page-table": {"foreign", "last_writer"},
    "transfer-detail": {"kind", "num_tokens", "status"},
}


def frame(at: AppTest, key: str) -> pl.DataFrame:
    found = [d.value for d in at.dataframe if TABLES[key] <= set(d.value.columns)]
    assert found, f"no table {key!r}"
    return pl.from_pandas(found[0])


def iso(window: fx.Window) -> dict[str, str]:
    assert window.from_ns is not None and window.to_ns is not None
    return {"from": format_utc(window.from_ns), "to": format_utc(window.to_ns + 999)}


def as_window(params: dict[str, str], **filters: str) -> fx.Window:
    return fx.Window(parse_utc(params["from"]), parse_utc(params["to"]), **filters)


def test_fleet_shows_the_node_configurations_and_the_pools_below_context(monkeypatch, seeded, window):
    p = iso(window)
    at = run_app(monkeypatch, seeded, "Fleet", **p)
    expected = fx.ask_node_configurations(seeded, as_window(p)).rows
    short = expected.filter(pl.col("shortfall_tokens") > 0)
    assert metric(at, "nodes") == str(expected["node"].n_unique())
    assert metric(at, "nodes below context") == str(short["node"].n_unique()) == "2"
    alert = at.error[0].value
    assert "2 node(s) have a KV pool smaller than the context they advertise" in alert
    assert "prefill-0 (prefill): pool 200,000 < context 400,000 tokens, short by 200,000" in alert
    shown = frame(at, "fleet-table")
    assert shown["node"].head(2).to_list() == ["prefill-0", "prefill-1"]  # below context first
    got = dict(zip(shown["node"], shown["shortfall_tokens"]))
    assert got == dict(zip(expected["node"], expected["shortfall_tokens"]))


@pytest.mark.parametrize("filters", [{}, {"node": "decode-0"}, {"tenant": "tenant-001"}])
def test_findings_affected_and_transfers_equal_the_api(monkeypatch, seeded, window, filters):
    p = iso(window)
    w = as_window(p, **filters)
    findings = fx.ask_findings(seeded, w).rows
    affected = fx.ask_affected(seeded, w).rows
    at = run_app(monkeypatch, seeded, "Findings", **p, **filters)
    assert metric(at, "findings") == str(len(findings))
    for sev in ("critical", "high", "medium"):
        assert metric(at, sev) == str(int((findings["severity"] == sev).sum()))
    counts = frame(at, "findings-counts")
    assert dict(zip(counts["code"], counts["findings"])) == dict(findings.group_by("code").len().iter_rows())
    table = frame(at, "findings-table")
    assert sorted(table["request_id"].drop_nulls()) == sorted(findings["request_id"].drop_nulls())
    assert table["evidence"].str.contains(r"^\d+:\d+").all()
    at = run_app(monkeypatch, seeded, "Affected responses", **p, **filters)
    assert metric(at, "affected responses") == str(len(affected)) != "0"
    assert metric(at, "pages read foreign") == str(int(affected["pages_read_foreign"].sum()))
    shown = frame(at, "affected-table")
    assert dict(zip(shown["request_id"], shown["pages_read_foreign"])) == dict(
        zip(affected["request_id"], affected["pages_read_foreign"])
    )
    at = run_app(monkeypatch, seeded, "Transfers", **p, **filters)
    assert metric(at, "length mismatches (F2)") == str(int((findings["code"] == "F2").sum()))
    assert metric(at, "digest mismatches (F3)") == str(int((findings["code"] == "F3").sum()))


def test_exposure_thresholds_and_exploitation_equal_the_api(monkeypatch, seeded, window):
    p = iso(window)
    w = as_window(p)
    at = run_app(monkeypatch, seeded, "Exposure", **p)
    matrix = fx.ask_exposure(seeded, w).rows
    shown = frame(at, "exposure-table")
    key = ["recipient_tenant", "victim_tenant"]
    assert (
        shown.select(*key, "responses", "pages").sort(key).rows()
        == matrix.select(*key, "responses", "pages").sort(key).rows()
    )
    thresholds = fx.ask_thresholds(seeded, w)
    assert thresholds.notes[0] in [m.value for m in at.markdown]
    ex = fx.ask_exploitation(seeded, ReportOptions(w.from_ns, w.to_ns), w).rows
    shown = frame(at, "exploitation-table")
    assert dict(zip(shown["tenant_id"], shown["verdict"])) == dict(zip(ex["tenant_id"], ex["verdict"]))
    assert metric(at, "tenants that stand out") == str(int((ex["verdict"] == "stands out").sum()))


def test_persisted_findings_are_read_instead_of_a_replay(monkeypatch, persisted, window):
    p = iso(window)
    at = run_app(monkeypatch, persisted, "Findings", **p)
    assert any("persisted findings (run 1)" in c.value for c in at.caption)
    assert metric(at, "findings") == str(len(fx.ask_findings(persisted, as_window(p)).rows))
    at = run_app(monkeypatch, persisted, "Affected responses", **p)
    assert metric(at, "affected responses") == str(len(fx.ask_affected(persisted, as_window(p)).rows))


def test_drill_down_shows_the_page_ownership_of_one_request(monkeypatch, seeded, window):
    p = iso(window)
    affected = fx.ask_affected(seeded, as_window(p)).rows
    victim = affected.filter(pl.col("victim_requests").list.len() > 0).row(0, named=True)
    at = run_app(monkeypatch, seeded, "Affected responses", **p, request=victim["request_id"])
    assert at.selectbox(key="affected-request").value == (victim["request_id"], victim["tenant_id"])
    pages = frame(at, "page-table")
    assert pages["foreign"].any() and len(pages) <= 24
    writers = set(pages.filter(pl.col("foreign"))["last_writer"].drop_nulls())
    assert writers and writers <= set(victim["victim_requests"])  # who wrote the foreign pages: its victims
    kinds = set(frame(at, "transfer-detail")["kind"])
    assert {"transfer_reserved", "transfer_received"} <= kinds
    assert metric(at, "prompt tokens") == str(victim["prompt_tokens"])


def test_report_view_generates_a_confirmed_report(monkeypatch, seeded, window):
    p = iso(window)
    at = run_app(monkeypatch, seeded, "Report", **p)
    at.button(key="report-generate").click().run()
    assert not at.exception
    assert any(s.value.startswith("verify-report: confirmed") for s in at.success), [e.value for e in at.error]
    assert metric(at, "affected responses") == str(len(fx.ask_affected(seeded, as_window(p)).rows))


INCIDENT = b"""organisation: Dashboard Test Cloud
incident_id: INC-DASH-7
contact:
  email: security@example.com
"""


def test_report_view_uses_an_uploaded_incident_yaml(monkeypatch, seeded, window):
    at = run_app(monkeypatch, seeded, "Report", **iso(window))
    at.file_uploader(key="report-context").set_value(("incident.yaml", INCIDENT, "application/x-yaml")).run()
    at.button(key="report-generate").click().run()
    assert not at.exception and [e.value for e in at.error] == []
    assert any(s.value.startswith("verify-report: confirmed") for s in at.success)
    with zipfile.ZipFile(io.BytesIO(at.session_state["report-result"][0])) as z:
        text = z.read("report/report.md").decode()
    assert "Dashboard Test Cloud" in text and "INC-DASH-7" in text and "security@example.com" in text
    bad = INCIDENT + b"detected_at: yesterday\n"
    at.file_uploader(key="report-context").set_value(("incident.yaml", bad, "application/x-yaml")).run()
    at.button(key="report-generate").click().run()
    assert not at.exception
    errors = [e.value for e in at.error]
    assert any(e.startswith("incident.yaml: field 'detected_at'") for e in errors), errors
    assert [s.value for s in at.success] == []


def test_empty_store_and_empty_window(monkeypatch, seeded, tmp_path, window):
    empty = tmp_path / "empty.duckdb"
    AuditStore(empty).close()
    at = run_app(monkeypatch, empty, "Fleet")
    assert "holds no audit events yet" in at.info[0].value
    at = run_app(
        monkeypatch, seeded, "Affected responses", **{"from": "2020-01-01T00:00:00Z", "to": "2020-01-02T00:00:00Z"}
    )
    assert "No audit events in this window" in at.info[0].value
    at = run_app(
        monkeypatch, seeded, "Fleet", **{"from": "2020-01-01T00:00:00Z", "to": "2020-01-01"}, node="no-such-node"
    )
    assert not at.metric


def test_error_pages_name_the_problem(monkeypatch, seeded, tmp_path):
    at = run_app(monkeypatch, tmp_path / "nowhere.duckdb", "Fleet")
    assert "Store not found" in at.error[0].value
    newer = tmp_path / "newer.duckdb"
    newer.write_bytes(seeded.read_bytes())
    with duckdb.connect(str(newer)) as con:
        con.execute("UPDATE meta SET value = '99' WHERE key = 'store_format'")
    at = run_app(monkeypatch, newer, "Fleet")
    assert "Store of another format" in at.error[0].value and "format 99" in at.error[0].value
    locked = tmp_path / "locked.duckdb"
    locked.write_bytes(seeded.read_bytes())
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import duckdb, sys, time; c = duckdb.connect(sys.argv[1]); print('held', flush=True); time.sleep(120)",
            str(locked),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        deadline = time.monotonic() + 30
        at = run_app(monkeypatch, locked, "Fleet")
        while not at.error and time.monotonic() < deadline:
            at = run_app(monkeypatch, locked, "Fleet")
        assert "Store locked by a writer" in at.error[0].value
        assert any("--url URL --token T" in m.value for m in at.markdown)
    finally:
        holder.kill()
        holder.wait()


def test_auto_refresh_is_off_by_default_and_selectable(monkeypatch, seeded, window):
    at = run_app(monkeypatch, seeded, "Transfers", **iso(window))
    assert at.toggle(key="refresh").value is False and not [s for s in at.selectbox if s.key == "refresh-s"]
    at.toggle(key="refresh").set_value(True).run()
    assert not at.exception
    assert at.selectbox(key="refresh-s").value == 10 and at.selectbox(key="refresh-s").options == [
        "5",
        "10",
        "30",
        "60",
        "300",
    ]
