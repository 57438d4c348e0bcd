"""A tenant token learns its own requests and counts, never another tenant's ids, request ids or node
names, through any route (reports, exposure, coverage and error messages included)."""

from __future__ import annotations

import pytest

from tests.service.access_fixtures import WINDOW, Served, bearer, served_fixture  # noqa: F401

TENANTS = ("mallory", "acme")


def _store_names(served: Served) -> tuple[set[str], dict[str, set[str]], set[str]]:
    cur = served.state.cursor()
    try:
        tenants = {r[0] for r in cur.execute("SELECT DISTINCT tenant_id FROM events_v WHERE tenant_id IS NOT NULL")
                   .fetchall()}
        requests: dict[str, set[str]] = {}
        for rid, tid in cur.execute("SELECT DISTINCT request_id, tenant_id FROM events_v "
                                    "WHERE request_id IS NOT NULL AND tenant_id IS NOT NULL").fetchall():
            requests.setdefault(tid, set()).add(rid)
        nodes = {r[0] for r in cur.execute("SELECT DISTINCT node FROM producers").fetchall()}
    finally:
        cur.close()
    return tenants, requests, nodes


def _responses(served: Served, me: str, others_request: str):
    token = served.tokens[f"tenant:{me}"]
    h = bearer(token)
    c = served.client
    gets = ["/v1/affected", "/v1/findings", "/v1/exposure", "/v1/thresholds", "/v1/exploitation", "/v1/nodes",
            "/v1/coverage", "/v1/audit/verify", "/v1/audit/heads", "/v1/tokens", "/v1/findings?since=0"]
    for path in gets:
        for params in ({}, WINDOW, {**WINDOW, "format": "csv"}, {**WINDOW, "format": "parquet"},
                       {**WINDOW, "tenant": me}, {"from": "2030-01-01", "to": "2020-01-01"}):
            yield path, params, c.get(path, params=params, headers=h)
    for params in ({"tenant": others_request.split("-")[0]}, {"node": "decode-0"},
                   {"exclude_tenant": others_request.split("-")[0]}):
        yield "/v1/affected", params, c.get("/v1/affected", params=params, headers=h)
    yield "/v1/reports", {}, c.post("/v1/reports", json={**WINDOW}, headers=h)
    yield "/v1/requests", {}, c.get(f"/v1/requests/{others_request}", headers=h)
    yield "/v1/requests", {}, c.get("/v1/requests/no-such-request", headers=h)
    yield "/v1/tokens", {}, c.post("/v1/tokens", json={"role": "operator"}, headers=h)


@pytest.mark.parametrize("me", TENANTS)
def test_no_route_shows_a_tenant_anything_of_another_tenant(served, me):
    tenants, requests, nodes = _store_names(served)
    other_tenant = sorted(tenants - {me})[0]
    others_request = sorted(requests[other_tenant])[0]
    forbidden = {t for t in tenants if t != me} | nodes
    forbidden |= {rid for tid, rids in requests.items() if tid != me for rid in rids}
    assert len(forbidden) > 20
    seen = 0
    for path, params, r in _responses(served, me, others_request):
        assert r.status_code < 500, (path, params, r.text)
        text = r.content.decode("latin-1") + " ".join(f"{k}: {v}" for k, v in r.headers.items())
        leaked = sorted(name for name in forbidden if name in text)
        assert not leaked, (path, params, r.status_code, leaked[:5])
        seen += r.status_code == 200
    assert seen >= 8  # the tenant's own routes did answer


def test_a_tenant_sees_its_own_affected_requests_with_counts(served):
    rows = served.get("/v1/affected", role="tenant:mallory").json()
    assert rows and all(r["request_id"].startswith("mallory-") for r in rows)
    assert all(r["other_requests"] >= 0 and r["other_tenants"] >= 1 for r in rows)
    assert set(rows[0]) == {"request_id", "http_status", "prompt_tokens", "completion_tokens", "codes",
                            "pages_read_foreign", "other_requests", "other_tenants", "first_ns", "last_ns"}


def test_a_victim_tenant_learns_its_data_was_read_and_by_how_many(served):
    acme = served.get("/v1/exposure", role="tenant:acme").json()
    assert acme["exposed"] and acme["reading_responses"] > 0 and acme["reading_tenants"] >= 1
    assert acme["my_requests_read"] and all(r.startswith("acme-") for r in acme["my_requests_read"])
    own = served.client.get(f"/v1/requests/{acme['my_requests_read'][0]}", headers=bearer(served.tokens["tenant:acme"]))
    assert own.status_code == 200 and own.json()["read_by_responses"] > 0


def test_another_tenants_request_is_the_same_404_as_none(served):
    h = bearer(served.tokens["tenant:mallory"])
    mine = served.get("/v1/affected", role="tenant:mallory").json()[0]["request_id"]
    assert served.client.get(f"/v1/requests/{mine}", headers=h).status_code == 200
    _, requests, _ = _store_names(served)
    acme_request = sorted(requests["acme"])[0]
    other = served.client.get(f"/v1/requests/{acme_request}", headers=h)
    none = served.client.get("/v1/requests/does-not-exist", headers=h)
    assert other.status_code == none.status_code == 404 and other.json() == none.json()
    assert served.get(f"/v1/requests/{acme_request}").status_code == 200  # an operator may ask for any request
