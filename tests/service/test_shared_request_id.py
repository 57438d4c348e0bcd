"""Two tenants' requests with the same request id (clients choose SGLang's ``rid``) never cross over: each
tenant's question about the id is about its own request, an operator names which one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvtrail.audit.batch import from_dicts
from kvtrail.audit.store import AuditStore
from kvtrail.service.app import create_app
from kvtrail.service.state import open_state
from kvtrail.service.tokens import add_token
from kvtrail.timeutil import format_utc
from tests.forensics.incident_fixture import LONG, SHORT, SHORT_ACME, W0, W1, Incident

WINDOW = {"from": format_utc(W0), "to": format_utc(W1)}
DUP = "dup-7"


def _renamed(inc: Incident, rid: str) -> int:
    """Give request ``rid`` the shared id; its transfer id."""
    req = next(e["request"] for e in inc.events if e.get("request", {}).get("request_id") == rid)
    req["request_id"] = DUP  # one dict shared by all its events
    return req["transfer_id"]


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Iterator[tuple[TestClient, dict[str, str], dict[str, int]]]:
    inc = Incident()
    acme = inc.request(10, "acme", SHORT_ACME)
    inc.request(11, "umbrella", SHORT)
    mallory = inc.request(13, "mallory", LONG)  # reads pages acme and umbrella wrote
    transfers = {"acme": _renamed(inc, acme), "mallory": _renamed(inc, mallory)}
    db = tmp_path_factory.mktemp("shared") / "shared.duckdb"
    with AuditStore(db) as store:
        store.append(from_dicts(inc.events))
    state = open_state(db)
    with state.write_lock:
        tokens = {r: add_token(state.store.con, r)[1] for r in ("operator", "tenant:acme", "tenant:mallory")}
    state.judge.wait_idle(60)
    try:
        with TestClient(create_app(state)) as client:
            yield client, tokens, transfers
    finally:
        state.close()


def _get(client: TestClient, token: str, path: str, **params):
    return client.get(path, params={**WINDOW, **params}, headers={"Authorization": f"Bearer {token}"})


def test_a_tenant_asking_about_a_shared_id_gets_only_its_own_request(shared):
    client, tokens, transfers = shared
    for me, other in (("mallory", "acme"), ("acme", "mallory")):
        r = _get(client, tokens[f"tenant:{me}"], f"/v1/requests/{DUP}/pages")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tenant_id"] == me and other not in r.text
        assert {t["transfer_id"] for t in body["transfers"]} == {transfers[me]}  # never the other's transfer
        own_spans = [s for s in body["spans"] if s["request_id"] == DUP]
        assert own_spans and all(s["holder"] == f"this request ({me})" for s in own_spans)
        assert body["response"]["prompt_tokens"] == (LONG if me == "mallory" else SHORT_ACME)


def test_the_victim_is_not_told_its_request_was_affected_by_the_other_tenants(shared):
    client, tokens, _ = shared
    acme = _get(client, tokens["tenant:acme"], f"/v1/requests/{DUP}")
    assert acme.status_code == 200, acme.text
    assert not acme.json()["affected"] and acme.json()["codes"] == []  # acme's own request read only its pages
    mallory = _get(client, tokens["tenant:mallory"], f"/v1/requests/{DUP}")
    assert mallory.status_code == 200 and mallory.json()["read_by_responses"] == 0  # nobody read mallory's data


def test_an_operator_names_the_tenant_of_a_shared_id(shared):
    client, tokens, transfers = shared
    both = _get(client, tokens["operator"], f"/v1/requests/{DUP}/pages")
    assert both.status_code == 409 and "acme" in both.text and "mallory" in both.text and "tenant=" in both.text
    assert _get(client, tokens["operator"], f"/v1/requests/{DUP}").status_code == 409
    for me in ("acme", "mallory"):
        one = _get(client, tokens["operator"], f"/v1/requests/{DUP}/pages", tenant=me)
        assert one.status_code == 200 and one.json()["tenant_id"] == me
        assert {t["transfer_id"] for t in one.json()["transfers"]} == {transfers[me]}
        assert _get(client, tokens["operator"], f"/v1/requests/{DUP}", tenant=me).status_code == 200
