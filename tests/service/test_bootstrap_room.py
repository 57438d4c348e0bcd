"""The service answers a bootstrap room (one transfer id: prefill's request id and decode's) as one transfer:
its findings name decode's request, and no answer warns that the producer's ids are suspect."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from kvtrail.audit.batch import from_dicts
from kvtrail.audit.store import AuditStore
from kvtrail.service.app import create_app
from kvtrail.service.state import open_state
from kvtrail.service.tokens import add_token
from tests.forensics.test_shared_ids import ROOM, _pd, _room


def test_the_service_judges_a_room_as_one_transfer(tmp_path):
    tl = _pd(pre="prefill-rid-1", dec="decode-rid-1")
    _room(tl, "pre", "dec", ROOM, sent_tokens=16, sent_digest=9)
    db = tmp_path / "room.duckdb"
    with AuditStore(db) as store:
        store.append(from_dicts(tl.events))
    state = open_state(db)
    try:
        with state.write_lock:
            token = add_token(state.store.con, "operator")[1]
        state.judge.wait_idle(60)
        with TestClient(create_app(state)) as client:
            window = {"from": "2000-01-01T00:00:00Z", "to": "2100-01-01T00:00:00Z", "format": "json"}
            r = client.get("/v1/findings", params=window, headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 200, r.text
            rows = r.json()
            assert sorted(row["code"] for row in rows) == ["F2", "F3"]
            assert {(row["request_id"], row["tenant_id"]) for row in rows} == {("decode-rid-1", "acme")}
            assert all("prefill's request id: prefill-rid-1" in row["detail"] for row in rows)
            assert json.loads(r.headers["x-kvtrail-answer"])["warnings"] == []
            # decode's request's drill-down shows prefill's sends for the room beside its own reservation and receipt
            drill = client.get(
                "/v1/requests/decode-rid-1/pages", params=window, headers={"Authorization": f"Bearer {token}"}
            )
            assert drill.status_code == 200, drill.text
            shown = [(t["kind"], t["node"], t["num_tokens"]) for t in drill.json()["transfers"]]
            assert shown == [("transfer_reserved", "d", 32), ("transfer_sent", "p", 16), ("transfer_received", "d", 32)]
            none = client.get(
                "/v1/requests/prefill-rid-1/pages", params=window, headers={"Authorization": f"Bearer {token}"}
            )
            assert [t["kind"] for t in none.json()["transfers"]] == ["transfer_sent"]  # its own only
    finally:
        state.close()
