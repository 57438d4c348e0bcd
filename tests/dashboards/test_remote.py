"""``RemoteSource``: the dashboard's data through a running service's API (in process here) equals the
forensics API's on the same store; a tenant token gets only its own tenant's view."""

from __future__ import annotations

import shutil
import socket

import polars as pl
import pytest

from kvtrail import forensics as fx
from kvtrail.errors import KvtrailError
from kvtrail.timeutil import format_utc

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from kvtrail.answers import persisted
from kvtrail.answers.remote import RemoteSource  # noqa: E402
from kvtrail.answers.store import StoreSource  # noqa: E402
from kvtrail.service.app import create_app  # noqa: E402
from kvtrail.service.state import open_state  # noqa: E402
from kvtrail.service.tokens import add_token  # noqa: E402
from tests.service.conftest import served_in_thread  # noqa: E402

TENANT = "tenant-000"


@pytest.fixture(scope="module")
def service(seeded, tmp_path_factory):
    """The seeded store served in process (TestClient) and over HTTP on loopback (for AppTest's sessions)."""
    db = tmp_path_factory.mktemp("dash-remote") / "svc.duckdb"
    shutil.copy(seeded, db)
    state = open_state(db)
    try:
        with state.write_lock:
            operator = add_token(state.store.con, "operator")[1]
            tenant = add_token(state.store.con, f"tenant:{TENANT}")[1]
        state.judge.wait_idle(120)  # its persisted findings then cover the window, as a running service's do
        with TestClient(create_app(state)) as client:
            yield client, operator, tenant, state
    finally:
        state.close()


@pytest.fixture(scope="module")
def http_url(service):
    """The service's app served by uvicorn in a thread on 127.0.0.1, port 0."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    try:
        with served_in_thread(service[3], sock) as url:
            yield url
    finally:
        sock.close()


def test_operator_views_equal_the_api(service, seeded, window):
    client, operator, _, _ = service
    src = RemoteSource("http://testserver", operator, transport=client._transport)
    assert src.role == "operator"
    assert {"prefill-0", "prefill-1", "decode-0", "decode-1"} <= set(src.choices()[0])
    affected = src.affected(window)
    expected = fx.ask_affected(seeded, window).rows
    assert dict(zip(affected["request_id"], affected["pages_read_foreign"])) == dict(
        zip(expected["request_id"], expected["pages_read_foreign"])
    )
    fleet = src.fleet(window)
    assert set(fleet.filter(pl.col("shortfall_tokens") > 0)["node"]) == {"prefill-0", "prefill-1"}
    assert len(src.findings(window)) == len(fx.ask_findings(seeded, window).rows)
    assert src.thresholds(window).sentence == fx.ask_thresholds(seeded, window).notes[0]
    assert int((src.transfers(window)["code"] == "F2").sum()) == int(
        (fx.ask_findings(seeded, window).rows["code"] == "F2").sum()
    )


def test_a_tenant_token_sees_its_tenant_only(service, seeded, window):
    client, _, tenant, _ = service
    src = RemoteSource("http://testserver", tenant, transport=client._transport)
    assert src.role == "tenant" and src.choices() == ([], [])
    mine = src.affected(window)
    expected = fx.ask_affected(seeded, window).rows.filter(pl.col("tenant_id") == TENANT)
    assert sorted(mine["request_id"]) == sorted(expected["request_id"])
    assert mine["victim_tenants"].list.len().sum() == 0  # other tenants' ids never reach a tenant
    exposure = src.exposure(window)
    assert set(exposure["recipient_tenant"]) <= {"(other tenants)"}


def test_the_remote_page_timeline_equals_the_local_one(service, seeded, window):
    client, operator, _, state = service
    cur = state.cursor()
    try:  # the service reads its judge's persisted findings; the store file below is replayed
        assert persisted.covering_run(cur, window.from_ns, window.to_ns) is not None
    finally:
        cur.close()
    src = RemoteSource("http://testserver", operator, transport=client._transport)
    affected = fx.ask_affected(seeded, window).rows
    rid = affected.filter(pl.col("victim_requests").list.len() > 0)["request_id"][0]
    remote, local = src.request(rid, window), StoreSource(seeded).request(rid, window)
    assert (remote.request_id, remote.tenant_id, remote.pages_read) == (
        local.request_id,
        local.tenant_id,
        local.pages_read,
    )
    for part in ("spans", "marks", "pages", "transfers"):
        assert getattr(remote, part).equals(getattr(local, part)), part
    order = ["last_ns", "first_ns", "code", "node"]  # a judge run's findings come in another order than a replay's
    assert remote.findings.sort(order).equals(local.findings.sort(order))
    assert remote.response == local.response
    assert len(remote.spans) and remote.pages["foreign"].any()


def test_a_tenant_gets_its_own_request_timeline_only(service, seeded, window):
    client, _, tenant, _ = service
    src = RemoteSource("http://testserver", tenant, transport=client._transport)
    affected = fx.ask_affected(seeded, window).rows
    mine = affected.filter((pl.col("tenant_id") == TENANT) & (pl.col("victim_requests").list.len() > 0))
    theirs = affected.filter(pl.col("tenant_id") != TENANT).row(0, named=True)
    d = src.request(mine["request_id"][0], window)
    assert d.tenant_id == TENANT and len(d.spans) and d.pages["foreign"].any()
    writers = set(d.pages.filter(pl.col("foreign"))["last_writer"].drop_nulls())
    assert writers and all(w.startswith("other request ") for w in writers)
    others = set(affected["tenant_id"]) - {TENANT}
    assert not others & (set(d.spans["tenant_id"]) | set(d.marks["tenant_id"]))
    with pytest.raises(KvtrailError, match="404"):
        src.request(theirs["request_id"], window)


def _element_texts(node) -> list[str]:
    """Every element's content under an AppTest block, as protobuf text (data frames and chart specs too)."""
    out = [str(node.proto)] if getattr(node, "proto", None) is not None else []
    for child in getattr(node, "children", {}).values():
        out.extend(_element_texts(child))
    return out


def test_a_tenant_token_session_shows_its_two_views_with_counts_only(monkeypatch, service, http_url, seeded, window):
    from streamlit.testing.v1 import AppTest

    from tests.dashboards.conftest import APP

    monkeypatch.delenv("KVTRAIL_DASHBOARD_DB", raising=False)
    monkeypatch.setenv("KVTRAIL_DASHBOARD_URL", http_url)
    monkeypatch.setenv("KVTRAIL_DASHBOARD_TOKEN", service[2])
    affected = fx.ask_affected(seeded, window).rows
    mine = affected.filter(pl.col("tenant_id") == TENANT)
    assert len(mine) and len(affected) > len(mine)
    with fx.open_store(seeded) as con:
        others = {
            r[0]
            for r in con.execute(
                "SELECT DISTINCT tenant_id FROM events_v WHERE tenant_id IS NOT NULL AND tenant_id <> ?", [TENANT]
            ).fetchall()
        }
        others |= {
            r[0]
            for r in con.execute(
                "SELECT DISTINCT request_id FROM events_v WHERE tenant_id IS NOT NULL AND tenant_id <> ?", [TENANT]
            ).fetchall()
        }
        others |= {r[0] for r in con.execute("SELECT DISTINCT node FROM producers").fetchall()}
    assert len(others) > 20
    bounds = {"from": format_utc(window.from_ns), "to": format_utc(window.to_ns + 999)}
    for view in ("Affected responses", "Exposure"):
        at = AppTest.from_file(str(APP), default_timeout=120)
        at.query_params.update({"view": view, **bounds})
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        assert [e.value for e in at.error] == []
        assert at.sidebar.radio(key="view").options == ["Affected responses", "Exposure"]
        assert at.sidebar.radio(key="view").value == view
        if view == "Affected responses":
            assert [m.value for m in at.metric if m.label == "affected responses"] == [str(len(mine))]
            table = [d.value for d in at.dataframe if {"pages_read_foreign", "other_tenants"} <= set(d.value.columns)]
            assert table and "victim_requests" not in table[0].columns  # victims as counts
            assert sorted(table[0]["request_id"]) == sorted(mine["request_id"])
            assert any({"foreign", "last_writer"} <= set(d.value.columns) for d in at.dataframe)  # the drill-down
        else:
            shown = [d.value for d in at.dataframe if {"recipient_tenant", "victim_tenant"} <= set(d.value.columns)]
            assert not shown or set(shown[0]["recipient_tenant"]) == {"(other tenants)"}
            assert any("not available to a tenant token" in c.value for c in at.caption)
        text = "\n".join(_element_texts(at.main) + _element_texts(at.sidebar))
        leaked = sorted(name for name in others if name in text)
        assert not leaked, (view, leaked[:5])
        if view == "Affected responses":  # the search does see tables and the timeline chart
            assert all(rid in text for rid in mine["request_id"]) and "other request 1" in text
