"""``GET /v1/coverage`` is bounded by ``from``/``to`` like every query route: a sequence gap counts only
when the batches around it overlap the window (``coverage_gaps`` without a window: the whole store)."""

from __future__ import annotations

from kvtrail.forensics import Window, coverage_gaps
from kvtrail.timeutil import format_utc
from tests.conftest import T0, alloc, config
from tests.service.conftest import arrow_body, auth, make_token

HOUR_NS = 3600 * 10**9


def test_coverage_counts_the_gaps_of_the_window_only(client, service_state):
    producer = make_token(service_state)
    operator = make_token(service_state, "operator")
    first = [config(0), *(alloc(s, [s]) for s in range(1, 10))]
    later = [alloc(s, [s], wall_ns=T0 + HOUR_NS + s) for s in range(15, 20)]  # seq 10..14 never arrive
    for batch in (first, later):
        r = client.post("/v1/events", content=arrow_body(batch), headers=auth(producer))
        assert r.status_code == 200, r.text

    def gaps(**window) -> list[dict]:
        r = client.get(
            "/v1/coverage",
            params={k: format_utc(v) for k, v in window.items()},
            headers={"Authorization": f"Bearer {operator}"},
        )
        assert r.status_code == 200, r.text
        return r.json()

    whole = [{"node": "prefill-0", "instance": "i1", "missing_events": 5, "reported_by_producer": 0, "unexplained": 5}]
    assert gaps() == whole
    assert gaps(**{"from": T0 - HOUR_NS, "to": T0 + 2 * HOUR_NS}) == whole
    assert gaps(**{"from": T0 - HOUR_NS, "to": T0 + HOUR_NS // 2}) == []  # only the first batch
    assert gaps(**{"from": T0 + HOUR_NS // 2, "to": T0 + 2 * HOUR_NS}) == []  # only the later one
    cur = service_state.cursor()
    try:
        assert coverage_gaps(cur).to_dicts() == whole == coverage_gaps(cur, Window(None, T0 + 2 * HOUR_NS)).to_dicts()
        assert coverage_gaps(cur, Window(T0 + HOUR_NS // 2, None)).is_empty()
    finally:
        cur.close()
