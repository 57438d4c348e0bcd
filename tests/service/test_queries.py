"""The query API in-process: each route gives the CLI's JSON rows, CSV and Parquet, 401/403, the live
judge's findings by cursor, the report archive, the audit routes and the access log of every query."""

from __future__ import annotations

import io
import json
import zipfile

import polars as pl
import pytest

from kvtrail.answers import pages
from kvtrail.answers.tables import json_text
from kvtrail.audit.heads import chain_heads
from kvtrail.forensics import (
    Window,
    ask_affected,
    ask_exploitation,
    ask_exposure,
    ask_findings,
    ask_node_configurations,
    ask_thresholds,
)
from kvtrail.forensics.options import ReportOptions
from kvtrail.report.verify import verify_report
from kvtrail.service import access
from kvtrail.service.tokens import add_token
from tests.forensics.incident_fixture import W0, W1
from tests.service.access_fixtures import Served, bearer, served_fixture  # noqa: F401

W = Window(W0, W1)
QUESTIONS = {
    "/v1/affected": lambda cur: ask_affected(cur, W),
    "/v1/findings": lambda cur: ask_findings(cur, W),
    "/v1/exposure": lambda cur: ask_exposure(cur, W),
    "/v1/thresholds": lambda cur: ask_thresholds(cur, W),
    "/v1/exploitation": lambda cur: ask_exploitation(cur, ReportOptions(W0, W1), W),
    "/v1/nodes": lambda cur: ask_node_configurations(cur, W),
}


def _local(served: Served, fn):
    cur = served.state.cursor()
    try:
        return fn(cur)
    finally:
        cur.close()


@pytest.mark.parametrize("path", sorted(QUESTIONS))
def test_each_route_answers_with_the_cli_json_rows(served, path):
    expected = _local(served, QUESTIONS[path])
    r = served.get(path)
    assert r.status_code == 200, r.text
    assert r.json() == json.loads(json_text(expected.rows))
    assert len(r.json()) > 0
    meta = json.loads(r.headers["x-kvtrail-answer"])
    assert meta["notes"] == list(expected.notes) and meta["warnings"] == list(expected.warnings)


def test_csv_and_parquet_carry_the_same_rows(served):
    rows = _local(served, QUESTIONS["/v1/affected"]).rows
    r = served.get("/v1/affected", format="parquet")
    assert r.headers["content-type"] == "application/vnd.apache.parquet"
    assert pl.read_parquet(io.BytesIO(r.content)).equals(rows)
    csv = served.get("/v1/affected", format="csv")
    assert csv.headers["content-type"].startswith("text/csv")
    assert csv.text.splitlines()[0] == ",".join(rows.columns) and len(csv.text.splitlines()) == len(rows) + 1


def test_filters_and_exclusions_are_the_clis(served):
    answer = _local(served, lambda cur: ask_affected(cur, Window(W0, W1, tenant="globex")))
    assert served.get("/v1/affected", tenant="globex").json() == json.loads(json_text(answer.rows))
    kept = served.get("/v1/affected", exclude_tenant="globex=internal tests")
    assert "globex" not in {row["tenant_id"] for row in kept.json()}
    meta = json.loads(kept.headers["x-kvtrail-answer"])
    assert meta["excluded_count"] == 4 and meta["excluded"] == [["tenant globex", "internal tests", 4]]
    only = served.get("/v1/findings", code="F1").json()
    assert only and {row["code"] for row in only} == {"F1"}


@pytest.mark.parametrize(
    "params, field",
    [
        ({"from": "yesterday"}, "from"),
        ({"to": "2026-13-01"}, "to"),
        ({"tenant": "nobody"}, "--tenant"),
        ({"code": "F99"}, "--code"),
    ],
)
def test_bad_parameters_are_400_naming_the_field(served, params, field):
    r = served.client.get("/v1/findings", params=params, headers=bearer(served.tokens["operator"]))
    assert r.status_code == 400 and r.json()["detail"].startswith(field)


def test_missing_bad_and_revoked_tokens_are_401_and_producers_403(served):
    assert served.client.get("/v1/affected").status_code == 401
    assert served.client.get("/v1/affected", headers=bearer("kvt_123456789abc_nope")).status_code == 401
    assert served.client.get("/v1/affected", headers={"Authorization": "Basic abc"}).status_code == 401
    with served.state.write_lock:
        token_id, secret = add_token(served.state.store.con, "operator")
    assert served.client.get("/v1/nodes", headers=bearer(secret)).status_code == 200
    assert served.client.get("/v1/nodes", headers=bearer(secret)).status_code == 200  # now a verified token
    revoked = served.client.delete(f"/v1/tokens/{token_id}", headers=bearer(served.tokens["operator"]))
    assert revoked.status_code == 200 and revoked.json() == {"revoked": True}
    r = served.client.get("/v1/nodes", headers=bearer(secret))  # refused from the next request on
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    for path in [*QUESTIONS, "/v1/coverage", "/v1/audit/verify", "/v1/audit/heads", "/v1/requests/x"]:
        assert served.get(path, role="producer").status_code == 403, path


def test_findings_since_follows_what_the_judge_persisted(served):
    first = served.get("/v1/findings", since=0)
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["findings"] and body["next"] == max(f["first_run_id"] for f in body["findings"])
    assert {"finding_id", "first_run_id", "code", "evidence"} <= set(body["findings"][0])
    again = served.get("/v1/findings", since=body["next"]).json()
    assert again == {"findings": [], "next": body["next"]}
    f1 = served.get("/v1/findings", since=0, code="F1", format="parquet")
    assert set(pl.read_parquet(io.BytesIO(f1.content))["code"]) == {"F1"}
    assert int(f1.headers["x-kvtrail-next"]) >= 1


def test_audit_routes_verify_the_chains_and_give_the_heads(served):
    doc = served.get("/v1/audit/verify").json()
    assert doc["ok"] and doc["batches_checked"] == 3 and doc["access_log"]["ok"]
    assert served.get("/v1/audit/heads").json() == {"heads": _local(served, chain_heads)}
    assert served.get("/v1/coverage").json() == []


def test_every_query_is_in_the_access_log_with_who_and_status(served):
    served.get("/v1/nodes", token="should-not-be-logged")
    served.client.get("/v1/nodes")
    served.get("/v1/nodes", role="tenant:mallory")
    rows = _local(
        served,
        lambda cur: cur.execute(
            "SELECT token_id, role, path, query, status FROM access_log ORDER BY entry_no DESC LIMIT 3"
        ).fetchall(),
    )
    (t_id, t_role, _, _, t_status), (anon_id, _, _, _, anon_status), (op_id, op_role, path, query, status) = rows
    assert (t_role, t_status) == ("tenant:mallory", 403) and t_id in served.tokens["tenant:mallory"]
    assert (anon_id, anon_status) == (None, 401)
    assert (op_role, path, status) == ("operator", "/v1/nodes", 200) and op_id in served.tokens["operator"]
    assert "should-not-be-logged" not in query and "from" in json.loads(query)
    assert _local(served, access.verify_access_log).ok


def test_request_pages_are_the_dashboards_drill_down(served):
    rid = served.get("/v1/affected").json()[0]["request_id"]
    r = served.get(f"/v1/requests/{rid}/pages")
    assert r.status_code == 200, r.text

    def local(cur):
        found = [f for f in ask_findings(cur, W).found if f.request_id == rid]
        return pages.detail_document(pages.request_detail(cur, rid, found))

    expected = _local(served, local)
    assert r.json() == json.loads(json.dumps(expected))
    assert r.json()["spans"] and any(p["foreign"] for p in r.json()["pages"])
    assert pages.detail_from_document(r.json()).pages.equals(
        _local(
            served,
            lambda cur: pages.request_detail(cur, rid, [f for f in ask_findings(cur, W).found if f.request_id == rid]),
        ).pages
    )


def test_a_report_comes_as_an_archive_that_verifies_against_the_store(served, tmp_path):
    r = served.client.post(
        "/v1/reports",
        json={"from": "2026-09-09T00:00:00Z", "to": "2026-09-09T06:00:00Z"},
        headers=bearer(served.tokens["operator"]),
    )
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/zip"
    summary = json.loads(r.headers["x-kvtrail-report"])
    assert summary["counts"]["affected_responses"] == 20
    out = tmp_path / "report"
    with zipfile.ZipFile(io.BytesIO(r.content)) as z:
        z.extractall(out)
        assert {"report.json", "report.md", "report.pdf", "affected_responses.csv"} <= set(z.namelist())
    manifest = json.loads((out / "report.json").read_text())
    assert manifest["results_digest"] == summary["results_digest"]
    heads = served.get("/v1/audit/heads").json()["heads"]
    assert [(h["producer_id"], h["batch_no"], h["digest"]) for h in manifest["chain_heads"]] == [
        (h["producer_id"], h["batch_no"], h["digest"]) for h in heads
    ]
    served.state.judge.wait_idle(60)
    served.state.close()  # the store file is free again (the last test of the module): verify as a CLI user would
    check = verify_report(out, served.state.db_path)
    assert check.ok, check.problems
