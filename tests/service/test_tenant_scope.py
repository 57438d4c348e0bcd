"""A tenant token learns its own requests and counts, never another tenant's ids, request ids or node
names, through any route (reports, exposure, coverage and error messages included)."""

from __future__ import annotations

import pytest

from tests.service.access_fixtures import WINDOW, Served, bearer, served_fixture  # noqa: F401

TENANTS = ("mallory", "acme")


def _store_names(served: Served) -> tuple[set[str], dict[str, set[str]], set[str]]:
    cur = served.state.cursor()
    try:
        tenants = {
            r[0] for r in cur.execute("SELECT DISTINCT tenant_id FROM events_v WHERE tenant_id IS NOT NULL").fetchall()
        }
        requests: dict[str, set[str]] = {}
        for rid, tid in cur.execute(
            "SELECT DISTINCT request_id, tenant_id FROM events_v WHERE request_id IS NOT NULL AND tenant_id IS NOT NULL"
        ).fetchall():
            requests.setdefault(tid, set()).add(rid)
        nodes = {r[0] for r in cur.execute("SELECT DISTINCT node FROM producers").fetchall()}
    finally:
        cur.close()
    return tenants, requests, nodes


def _responses(served: Served, me: str, others_request: str, own_request: str):
    token = served.tokens[f"tenant:{me}"]
    h = bearer(token)
    c = served.client
    gets = [
        "/v1/affected",
        "/v1/findings",
        "/v1/exposure",
        "/v1/thresholds",
        "/v1/exploitation",
        "/v1/nodes",
        "/v1/coverage",
        "/v1/audit/verify",
        "/v1/audit/heads",
        "/v1/tokens",
        "/v1/findings?since=0",
    ]
    for path in gets:
        for params in (
            {},
            WINDOW,
            {**WINDOW, "format": "csv"},
            {**WINDOW, "format": "parquet"},
            {**WINDOW, "tenant": me},
            {"from": "2030-01-01", "to": "2020-01-01"},
        ):
            yield path, params, c.get(path, params=params, headers=h)
    for params in (
        {"tenant": others_request.split("-")[0]},
        {"node": "decode-0"},
        {"exclude_tenant": others_request.split("-")[0]},
    ):
        yield "/v1/affected", params, c.get("/v1/affected", params=params, headers=h)
    yield "/v1/reports", {}, c.post("/v1/reports", json={**WINDOW}, headers=h)
    yield "/v1/requests", {}, c.get(f"/v1/requests/{others_request}", headers=h)
    yield "/v1/requests", {}, c.get("/v1/requests/no-such-request", headers=h)
    yield "/v1/requests/pages", {}, c.get(f"/v1/requests/{others_request}/pages", params=WINDOW, headers=h)
    yield "/v1/requests/pages", {}, c.get(f"/v1/requests/{own_request}/pages", params=WINDOW, headers=h)
    yield "/v1/requests/pages", {}, c.get(f"/v1/requests/{own_request}/pages", params={"node": "decode-0"}, headers=h)
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
    for path, params, r in _responses(served, me, others_request, sorted(requests[me])[0]):
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
    assert set(rows[0]) == {
        "request_id",
        "http_status",
        "prompt_tokens",
        "completion_tokens",
        "codes",
        "pages_read_foreign",
        "other_requests",
        "other_tenants",
        "first_ns",
        "last_ns",
    }


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


def _forbidden_for(served: Served, me: str) -> set[str]:
    tenants, requests, nodes = _store_names(served)
    return (
        {t for t in tenants if t != me} | nodes | {rid for tid, rids in requests.items() if tid != me for rid in rids}
    )


def test_a_tenants_request_pages_show_others_only_as_pseudonyms(served):
    h = bearer(served.tokens["tenant:mallory"])
    mine = served.get("/v1/affected", role="tenant:mallory").json()[0]["request_id"]
    r = served.client.get(f"/v1/requests/{mine}/pages", params=WINDOW, headers=h)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["request_id"] == mine and body["tenant_id"] == "mallory" and body["pages_read"] > 0
    foreign = [p for p in body["pages"] if p["foreign"]]
    assert foreign and all(p["last_writer"].startswith("other request ") for p in foreign if p["last_writer"])
    holders = {s["holder"] for s in body["spans"]}
    assert "this request (mallory)" in holders and any(h.startswith("other request ") for h in holders)
    assert {s["node"] for s in body["spans"]} <= {"node 1", "node 2", "node 3"}
    assert all(f["evidence"] is None and f["detail"] is None for f in body["findings"])
    leaked = sorted(name for name in _forbidden_for(served, "mallory") if name in r.text)
    assert not leaked, leaked[:5]
    operator = served.get(f"/v1/requests/{mine}/pages")
    assert operator.status_code == 200 and "decode-0" in operator.text  # an operator sees the real names
    assert len(operator.json()["spans"]) == len(body["spans"])


def test_another_tenants_request_pages_are_the_same_404_as_none(served):
    h = bearer(served.tokens["tenant:mallory"])
    _, requests, _ = _store_names(served)
    other = served.client.get(f"/v1/requests/{sorted(requests['acme'])[0]}/pages", params=WINDOW, headers=h)
    none = served.client.get("/v1/requests/does-not-exist/pages", params=WINDOW, headers=h)
    assert other.status_code == none.status_code == 404 and other.json() == none.json()
    assert served.get("/v1/requests/does-not-exist/pages").status_code == 404
    assert served.get(f"/v1/requests/{sorted(requests['acme'])[0]}/pages", role="producer").status_code == 403
