"""Per-token query bounds: a token's queries beyond its running and waiting bounds get 429 with Retry-After,
before any work is done, while ingest keeps acking (a real uvicorn server on loopback)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvtrail.service.limits import QueryLimiter, QueryLimits, TooManyQueries
from kvtrail.service.state import open_state
from kvtrail.service.tokens import add_token
from tests.conftest import config, producer
from tests.forensics.incident_fixture import build
from tests.service.access_fixtures import WINDOW
from tests.service.conftest import arrow_body, auth, free_socket, served_in_thread

QUERIES = 24


def test_a_flood_of_one_tokens_queries_gets_429s_while_ingest_acks(tmp_path):
    db = tmp_path / "incident.duckdb"
    build(db)
    state = open_state(db, query_limits=QueryLimits(per_token=1, queue_per_token=1, retry_after_s=2))
    try:
        with state.write_lock:
            flooder = add_token(state.store.con, "operator")[1]
            other = add_token(state.store.con, "operator")[1]
            ingest = add_token(state.store.con, "producer")[1]
        with served_in_thread(state, free_socket()) as url, httpx.Client(base_url=url, timeout=120) as http:
            start = threading.Barrier(QUERIES + 1)

            def query(_: int) -> httpx.Response:
                start.wait()
                # the SQL engine is never answered from the judge's cache: each one replays the window
                params = {**WINDOW, "engine": "sql"}
                return http.get("/v1/findings", params=params, headers={"Authorization": f"Bearer {flooder}"})

            with ThreadPoolExecutor(QUERIES) as pool:
                pending = pool.map(query, range(QUERIES))
                start.wait()
                ack = http.post("/v1/events", content=arrow_body([config(0, producer("late-0"))]), headers=auth(ingest))
                mine = http.get("/v1/nodes", params=WINDOW, headers={"Authorization": f"Bearer {other}"})
                answers = list(pending)
                statuses = [r.status_code for r in answers]
        assert ack.status_code == 200 and ack.json()["events"] == 1  # ingest answered, committed
        assert mine.status_code == 200  # another token is not refused for the flooder's queries
        refused = [r for r in answers if r.status_code == 429]
        assert set(statuses) == {200, 429} and len(refused) == state.limiter.refused
        assert all(r.headers["Retry-After"] == "2" and "retry after 2 s" in r.json()["detail"] for r in refused)
        # one running and one waiting at most: every query beyond them, of those that overlapped, was refused
        assert statuses.count(200) >= 2
    finally:
        state.close()


@pytest.mark.parametrize("field", ["per_token", "total", "retry_after_s", "queue_per_token"])
def test_limits_name_a_bad_field(field):
    with pytest.raises(ValueError, match=field):
        QueryLimits(**{field: -1})


def test_a_freed_slot_goes_to_the_token_that_waited():
    import asyncio

    limiter = QueryLimiter(QueryLimits(per_token=1, queue_per_token=1, total=1))

    async def scenario() -> list[str]:
        order: list[str] = []
        await limiter.acquire("a")
        waiting = asyncio.create_task(limiter.acquire("b"))
        await asyncio.sleep(0)
        with pytest.raises(TooManyQueries):
            await limiter.acquire("b")  # b's one waiting place is taken
        order.append("a runs")
        limiter.release("a")
        await waiting
        order.append("b runs")
        limiter.release("b")
        return order

    assert asyncio.run(scenario()) == ["a runs", "b runs"]
    assert limiter.refused == 1
