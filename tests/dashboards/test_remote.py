"""``RemoteSource``: the dashboard's data through a running service's API (in process here) equals the
forensics API's on the same store; a tenant token gets only its own tenant's view."""

from __future__ import annotations

import shutil

import polars as pl
import pytest

from kvtrail import forensics as fx

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from kvtrail.dashboards.remote_source import RemoteSource  # noqa: E402
from kvtrail.service.app import create_app  # noqa: E402
from kvtrail.service.state import open_state  # noqa: E402
from kvtrail.service.tokens import add_token  # noqa: E402


@pytest.fixture(scope="module")
def service(seeded, tmp_path_factory):
    db = tmp_path_factory.mktemp("dash-remote") / "svc.duckdb"
    shutil.copy(seeded, db)
    state = open_state(db)
    try:
        with state.write_lock:
            operator = add_token(state.store.con, "operator")[1]
            tenant = add_token(state.store.con, "tenant:tenant-000")[1]
        with TestClient(create_app(state)) as client:
            yield client, operator, tenant
    finally:
        state.close()


def test_operator_views_equal_the_api(service, seeded, window):
    client, operator, _ = service
    src = RemoteSource("http://testserver", operator, transport=client._transport)
    assert src.role == "operator"
    assert {"prefill-0", "prefill-1", "decode-0", "decode-1"} <= set(src.choices()[0])
    affected = src.affected(window)
    expected = fx.ask_affected(seeded, window).rows
    assert dict(zip(affected["request_id"], affected["pages_read_foreign"])) == dict(
        zip(expected["request_id"], expected["pages_read_foreign"]))
    fleet = src.fleet(window)
    assert set(fleet.filter(pl.col("shortfall_tokens") > 0)["node"]) == {"prefill-0", "prefill-1"}
    assert len(src.findings(window)) == len(fx.ask_findings(seeded, window).rows)
    assert src.thresholds(window).sentence == fx.ask_thresholds(seeded, window).notes[0]
    assert int((src.transfers(window)["code"] == "F2").sum()) == int(
        (fx.ask_findings(seeded, window).rows["code"] == "F2").sum())


def test_a_tenant_token_sees_its_tenant_only(service, seeded, window):
    client, _, tenant = service
    src = RemoteSource("http://testserver", tenant, transport=client._transport)
    assert src.role == "tenant" and src.choices() == ([], [])
    mine = src.affected(window)
    expected = fx.ask_affected(seeded, window).rows.filter(pl.col("tenant_id") == "tenant-000")
    assert sorted(mine["request_id"]) == sorted(expected["request_id"])
    assert mine["victim_tenants"].list.len().sum() == 0  # other tenants' ids never reach a tenant
    exposure = src.exposure(window)
    assert set(exposure["recipient_tenant"]) <= {"(other tenants)"}
