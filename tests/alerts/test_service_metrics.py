"""``GET /metrics`` of the service: no token, Prometheus' text format, values from the store it owns,
and the live judge's lag."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from kvtrail.alerts import CONTENT_TYPE
from tests.alerts.histories import foreign_read, node_configs
from tests.service.conftest import NDJSON, auth, client, jsonl_body, producer_token, service_state  # noqa: F401


def _samples(text: str) -> dict[tuple, float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_metrics_without_a_token_follow_ingest_and_the_judge(client, producer_token, service_state):  # noqa: F811
    now = time.time_ns()
    for batch in (node_configs(wall_ns=now)[:1], [node_configs(wall_ns=now)[1], *foreign_read(wall_ns=now + 10)]):
        r = client.post("/v1/events", content=jsonl_body(batch), headers=auth(producer_token, NDJSON))
        assert r.status_code == 200, r.text
    assert service_state.judge.wait_idle(60)
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"] == CONTENT_TYPE
    got = _samples(r.text)
    pre = (("node", "prefill-0"), ("role", "prefill"))
    assert got[("kvtrail_node_kv_pool_tokens", pre)] == 681_280
    assert got[("kvtrail_forensics_findings_total", (("code", "F1"), ("node", "decode-0")))] == 2
    dec_producer = (("node", "decode-0"), ("producer", "c1/decode-0/decode"), ("role", "decode"))
    assert got[("kvtrail_judge_lag_seconds", dec_producer)] == 0.0  # judged
    assert got[("kvtrail_ingest_events_total", dec_producer)] == 7
    # the live judge's model monitors saw the same foreign read
    nfr = ("kvtrail_model_violations_total", (("node", "decode-0"), ("property", "no_foreign_read")))
    assert got[nfr] == 1
    assert got[("kvtrail_model_violations_total", (("node", "prefill-0"), ("property", "no_foreign_read")))] == 0
    assert "/metrics" in client.get("/openapi.json").json()["paths"]
