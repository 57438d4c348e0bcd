"""The disclosure report's words from each tenant's point of view, on a store whose truth is known
(``restart_fixture``): a tenant is never another customer of itself, never-written pages are no customer's
data, a restarted node is one node over time, and the example incident file fits the demo's tenants."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import polars as pl
import pytest
import yaml
from fastapi.testclient import TestClient

from kvtrail.cli import main
from kvtrail.forensics import AFFECTED_CODES, Window, ask_findings, ask_thresholds
from kvtrail.forensics.analysis import exposed_tenants, exposure_links, response_reads
from kvtrail.forensics.findings import NEVER_WRITTEN, UNKNOWN_TENANT
from kvtrail.report import charts
from kvtrail.service.app import create_app
from kvtrail.service.state import open_state
from kvtrail.service.tokens import add_token
from kvtrail.timeutil import format_utc
from tests.forensics.incident_fixture import W0
from tests.forensics.restart_fixture import DECODE_POOL_TOKENS, TRUTH, W1, WINDOW, build_restarted
from tests.service.access_fixtures import bearer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    base = tmp_path_factory.mktemp("words")
    db = base / "restarted.duckdb"
    build_restarted(db)
    out = base / "out"
    assert (
        main(
            [
                "forensics",
                "report",
                "--db",
                str(db),
                *WINDOW,
                "--out",
                str(out),
                "--context",
                str(ROOT / "docs" / "incident.example.yaml"),
            ]
        )
        == 0
    )
    return db, out


def _notice(md: str, tenant: str) -> str:
    """The text of one tenant's notice in report.md."""
    start = md.index(f"### Notice to {tenant}")
    end = md.find("###", start + 4)
    return md[start : end if end > 0 else len(md)]


def test_each_response_is_told_what_it_read(made):
    db, out = made
    affected = pl.read_csv(out / "affected_responses.csv")
    assert set(affected["request_id"]) == set(TRUTH)
    found = ask_findings(db, Window(W0, W1), codes=tuple(sorted(AFFECTED_CODES))).rows
    reads = response_reads(exposure_links(found, set(TRUTH)), affected.select("request_id", "tenant_id"))
    assert dict(zip(reads["request_id"], reads["read"])) == TRUTH
    md = (out / "report.md").read_text()
    assert (
        "1 read other customers' data (pages another tenant's requests wrote), 1 only pages other requests of "
        "their own tenant wrote, 1 only stale or uninitialised memory"
    ) in md
    assert "Victim tenants (whose data another customer read): 1" in md


def test_a_tenant_is_never_another_customer_of_itself(made):
    _, out = made
    exposed = {e["victim_tenant"]: e for e in json.loads((out / "exposed_tenants.json").read_text())}
    assert set(exposed) == {"acme"}  # never-written pages are nobody's data
    acme = exposed["acme"]
    assert (acme["recipient_tenants"], acme["recipient_count"], acme["responses"], acme["pages"]) == ("globex", 1, 1, 6)
    assert (
        acme["victim_request_ids"],
        acme["same_tenant_responses"],
        acme["same_tenant_pages"],
        acme["same_tenant_victim_request_ids"],
    ) == ("acme-2", 1, 6, "acme-2")
    csv = pl.read_csv(out / "exposed_tenants.csv")
    assert csv["recipient_tenants"].to_list() == ["globex"] and csv["same_tenant_responses"].to_list() == [1]
    md = (out / "report.md").read_text()
    acme_notice = _notice(md, "Acme Corp")
    assert "in 1 response(s) to 1 other customer account(s)" in acme_notice
    assert "1 other response(s) to your own account" in acme_notice
    assert "1 response(s) your account received at" in acme_notice and "no other customer's data" in acme_notice
    assert "may contain fragments of other customers' data" not in acme_notice
    assert "may contain fragments of other customers' data (request ids: globex-4)" in _notice(md, "Globex Inc")
    art33 = md[md.index("(a) Nature of the breach") : md.index("(b) Contact point")]
    assert (
        "KV-cache memory left by 1 earlier request of 1 customer account was used to generate 1 response to "
        "1 customer account, each time an account other than the one whose request left it"
    ) in art33
    assert (
        "memory left by 1 earlier request was used to generate 1 response to the account whose requests left it"
    ) in art33
    assert not re.search(r"[2-9] other customer account", md)


def test_a_tenant_token_gets_the_reports_numbers(made, tmp_path):
    db, out = made
    shutil.copy(db, tmp_path / "s.duckdb")
    state = open_state(tmp_path / "s.duckdb")
    try:
        with state.write_lock:
            tokens = {t: add_token(state.store.con, f"tenant:{t}")[1] for t in ("acme", "initech")}
        state.judge.wait_idle(60)
        with TestClient(create_app(state)) as client:
            window = {"from": format_utc(W0), "to": format_utc(W1)}
            acme = client.get("/v1/exposure", params=window, headers=bearer(tokens["acme"])).json()
            initech = client.get("/v1/exposure", params=window, headers=bearer(tokens["initech"])).json()
    finally:
        state.close()
    row = json.loads((out / "exposed_tenants.json").read_text())[0]
    assert (acme["reading_tenants"], acme["reading_responses"], acme["pages"], acme["my_requests_read"]) == (
        row["recipient_count"],
        row["responses"],
        row["pages"],
        row["victim_request_ids"].split(","),
    )
    assert (acme["same_tenant_responses"], acme["same_tenant_pages"]) == (
        row["same_tenant_responses"],
        row["same_tenant_pages"],
    )
    assert not initech["exposed"] and initech["reading_tenants"] == 0  # it read only never-written pages


def test_never_written_pages_are_no_customers_data(made):
    _, out = made
    notice = _notice((out / "report.md").read_text(), "Initech LLC")
    assert "read stale or uninitialised memory" in notice and "no customer's data was identified" in notice
    assert "initech-1" in notice and "other customers' data" not in notice
    md = (out / "report.md").read_text()
    assert "1 response read only stale or uninitialised memory" in md


def test_a_restarted_node_is_one_node_over_time(made, capsys):
    db, out = made
    rows = ask_thresholds(db, Window(W0, W1)).rows.filter(pl.col("node") == "prefill-0").sort("instance")
    assert rows.select("instance", "requests", "affected").rows() == [("i1", 4, 3), ("i2", 2, 0)]
    capsys.readouterr()
    assert main(["forensics", "thresholds", "--db", str(db), *WINDOW]) == 0
    assert "3 of 6 prefill requests affected" in capsys.readouterr().out
    md = (out / "report.md").read_text()
    assert "| prefill-0 | i1 | 128 | 4 | 3 | 3 | 0 |" in md and "| prefill-0 | i2 | 128 | 2 | 0 | 0 | 1 |" in md
    capacity = ask_thresholds(db, Window(W0, W1)).rows
    values = charts.pool_vs_context(capacity).to_dict()["datasets"]
    bars = next(iter(values.values()))
    decode = [b for b in bars if b["node"] == "decode-0"]
    assert [b["pool_tokens"] for b in decode] == [DECODE_POOL_TOKENS] * 2
    assert len({b["configuration"] for b in bars}) == len(bars)  # never stacked under one name
    assert {b["configuration"] for b in decode} == {"decode-0 (i1)", "decode-0 (i2)"}


def test_the_example_incident_file_fits_the_demos_tenants(made, tmp_path, capsys):
    db, _ = made
    example = yaml.safe_load((ROOT / "docs" / "incident.example.yaml").read_text())
    assert set(example["tenant_names"]) == {"acme", "globex", "initech"}  # kvtrail demo's tenants
    example["exclusions"]["tenants"] = [{"id": "internal-qa", "reason": "our own tests"}]
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(example))
    capsys.readouterr()
    assert (
        main(
            [
                "forensics",
                "report",
                "--db",
                str(db),
                *WINDOW,
                "--out",
                str(tmp_path / "o"),
                "--context",
                str(tmp_path / "mine.yaml"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "mine.yaml: exclusions.tenants[0]: unknown tenant 'internal-qa'" in err
    assert main(["forensics", "affected", "--db", str(db), *WINDOW, "--exclude-tenant", "nobody"]) == 2
    assert "--exclude-tenant: unknown tenant 'nobody'" in capsys.readouterr().err


def test_an_unknown_tenant_is_nobodys_same_tenant():
    links = pl.DataFrame(
        {
            "request_id": ["r1", "r2", "r3"],
            "recipient_tenant": [UNKNOWN_TENANT, "a", "a"],
            "victim_tenant": [UNKNOWN_TENANT, "a", NEVER_WRITTEN],
            "victim_request_id": ["v1", "v2", None],
            "node": ["d"] * 3,
            "page": [1, 2, 3],
        }
    )
    affected = pl.DataFrame({"request_id": ["r1", "r2", "r3"], "tenant_id": [None, "a", "a"]})
    reads = response_reads(links, affected)
    assert dict(zip(reads["request_id"], reads["read"])) == {
        "r1": "other_tenants",
        "r2": "same_tenant",
        "r3": "never_written",
    }
    exposed = exposed_tenants(links)
    assert exposed.select("victim_tenant", "recipient_count", "same_tenant_responses").rows() == [("a", 0, 1)]
