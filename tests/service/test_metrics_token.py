"""``/metrics`` names every node: ``serve --metrics-token`` makes it need an operator or metrics token, and a
metrics token reads nothing else."""

from __future__ import annotations

from fastapi.testclient import TestClient

from kvtrail.service.app import create_app
from kvtrail.service.tokens import add_token, parse_role
from tests.conftest import config, producer
from tests.service.conftest import arrow_body, auth


def test_metrics_token_guards_the_node_names(service_state):
    with service_state.write_lock:
        secrets = {r: add_token(service_state.store.con, r)[1] for r in ("producer", "metrics", "tenant:acme")}
    with TestClient(create_app(service_state, metrics_token=True)) as c:
        r = c.post(
            "/v1/events", content=arrow_body([config(0, producer("decode-9"))]), headers=auth(secrets["producer"])
        )
        assert r.status_code == 200, r.text
        service_state.judge.wait_idle(60)
        assert c.get("/metrics").status_code == 401
        tenant = c.get("/metrics", headers={"Authorization": f"Bearer {secrets['tenant:acme']}"})
        assert tenant.status_code == 403 and "decode-9" not in tenant.text
        ok = c.get("/metrics", headers={"Authorization": f"Bearer {secrets['metrics']}"})
        assert ok.status_code == 200 and 'node="decode-9"' in ok.text
        h = {"Authorization": f"Bearer {secrets['metrics']}"}
        assert c.get("/v1/nodes", headers=h).status_code == 403  # a metrics token asks nothing else
        assert c.post("/v1/events", content=arrow_body([config(1, producer("decode-9"))]), headers=h).status_code == 403
    with TestClient(create_app(service_state)) as c:  # without the flag: no token, as before
        assert c.get("/metrics").status_code == 200


def test_metrics_is_a_role():
    assert parse_role("metrics") == ("metrics", None)
