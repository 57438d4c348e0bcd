"""Secrets and scopes over HTTP: token-shaped text never reaches the access log, an expired token is 401,
a producer token bound to a node is bound to its cluster and role too."""

from __future__ import annotations

import json
import time

from kvtrail.service import access, tokens
from tests.conftest import config, producer
from tests.service.conftest import arrow_body, auth


def _add(state, role: str, binding: tokens.Binding) -> str:
    with state.write_lock:
        return tokens.add_token(state.store.con, role, binding=binding)[1]


def _last_access(state) -> tuple[str, str]:
    cur = state.cursor()
    try:
        return cur.execute("SELECT path, query FROM access_log ORDER BY entry_no DESC LIMIT 1").fetchone()
    finally:
        cur.close()


def test_a_token_in_the_query_string_is_redacted_whatever_its_name(client, service_state):
    operator = _add(service_state, "operator", tokens.Binding())
    token_id = operator.split("_")[1]
    r = client.get(
        "/v1/nodes",
        params={"tkn": operator, "note": f"see {operator} here", "k": ["a", operator]},
        headers=auth(operator, "application/json"),
    )
    assert r.status_code == 200, r.text
    path, query = _last_access(service_state)
    secret = operator.split("_", 2)[2]
    assert secret not in query and secret not in path
    logged = json.loads(query)
    assert logged["tkn"] == f"kvt_{token_id}_[redacted]" and logged["note"] == f"see kvt_{token_id}_[redacted] here"
    assert logged["k"] == ["a", f"kvt_{token_id}_[redacted]"]
    client.get(f"/v1/requests/{operator}", headers=auth(operator, "application/json"))  # in the path, too
    path, _ = _last_access(service_state)
    assert secret not in path and path.endswith(f"kvt_{token_id}_[redacted]")
    cur = service_state.cursor()
    try:
        assert access.verify_access_log(cur).ok  # the chain covers the rows as stored
    finally:
        cur.close()


def test_an_expired_token_is_401(client, service_state):
    now = time.time_ns()
    expired = _add(service_state, "operator", tokens.Binding(expires_ns=now - 1))
    soon = _add(service_state, "operator", tokens.Binding(expires_ns=now + 3 * 10**9))
    r = client.get("/v1/nodes", headers=auth(expired, "application/json"))
    assert r.status_code == 401 and "expired" in r.json()["detail"]
    assert client.get("/v1/nodes", headers=auth(soon, "application/json")).status_code == 200
    time.sleep(max(0.0, (now + 3 * 10**9 - time.time_ns()) / 1e9) + 0.05)
    assert client.get("/v1/nodes", headers=auth(soon, "application/json")).status_code == 401  # even when cached


def test_a_node_bound_producer_token_is_bound_to_its_cluster_and_role(client, service_state):
    own = producer()  # c1 / prefill-0 / prefill
    token = _add(service_state, "producer", tokens.Binding((own["node"],), (own["cluster"],), (own["role"],)))
    for other, field in (
        (producer(cluster="c2"), "cluster"),
        (producer(role="decode"), "role"),
        (producer(node="prefill-1"), "node"),
    ):
        r = client.post("/v1/events", content=arrow_body([config(0, prod=other)]), headers=auth(token))
        assert r.status_code == 403 and r.json()["detail"].startswith(f"{field}: "), r.text
    r = client.post("/v1/events", content=arrow_body([config(0, prod=own)]), headers=auth(token))
    assert r.status_code == 200, r.text
    # bound to the node name only (as before): any cluster and role
    by_name = _add(service_state, "producer", tokens.Binding(("prefill-0",)))
    r = client.post("/v1/events", content=arrow_body([config(0, prod=producer(cluster="c2"))]), headers=auth(by_name))
    assert r.status_code == 200, r.text
