"""HttpSink: a recorder committing to a service over HTTP; retries, lost replies, refused batches, and a
service that is down while the serving path keeps recording."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest

from kvtrail.audit.batch import from_dicts, read_ipc, wire_table, write_ipc
from kvtrail.audit.events import Producer, RequestRef
from kvtrail.audit.httpsink import HttpSink, HttpSinkConfig
from kvtrail.audit.recorder import Recorder, RecorderConfig
from kvtrail.errors import StoreError, ValidationError
from tests.conftest import alloc, config
from tests.service.conftest import free_socket, make_token, served_in_thread

PRODUCER = Producer("c1", "decode-3", "decode", "kvtrail-reference", "0.1", "boot-1")
FAST = HttpSinkConfig(connect_timeout_s=1.0, timeout_s=10.0, retries=2, backoff_s=0.01)


def _events(state, where: str = "TRUE") -> list[tuple]:
    cur = state.cursor()
    try:
        return cur.execute(
            f"SELECT kind, seq, gap_reason, dropped_events FROM events_v WHERE {where} ORDER BY seq"
        ).fetchall()
    finally:
        cur.close()


def _record(rec: Recorder, n: int, start: int = 0) -> float:
    """Record ``n`` allocations; returns the slowest call in seconds."""
    slowest = 0.0
    pages = np.arange(1, 9)
    for i in range(start, start + n):
        t = time.perf_counter()
        rec.pages_allocated(RequestRef(f"r{i}", tenant_id="acme"), pages, "decode_growth")
        slowest = max(slowest, time.perf_counter() - t)
    return slowest


def test_a_recorder_commits_through_the_service(service_state):
    token = make_token(service_state)
    with served_in_thread(service_state, free_socket()) as url:
        rec = Recorder(HttpSink(url, token, FAST), PRODUCER)
        rec.node_config(pool_tokens=1024, pool_pages=64, page_size=16, context_tokens=4096)
        _record(rec, 100)
        assert rec.flush(30)
        rec.close()
        stats = rec.stats()
    kinds = [k for k, *_ in _events(service_state)]
    assert kinds[0] == "recorder_started" and kinds[-1] == "recorder_closed" and kinds.count("pages_allocated") == 100
    assert stats["committed_events_total"] == len(kinds) and stats["writer_errors_total"] == 0


def test_a_url_where_a_store_path_goes_takes_the_token_from_the_environment(service_state, monkeypatch):
    monkeypatch.setenv("KVTRAIL_TOKEN", make_token(service_state))
    with served_in_thread(service_state, free_socket()) as url:
        with Recorder(url, PRODUCER) as rec:
            rec.node_config(pool_tokens=1024, pool_pages=64, page_size=16, context_tokens=4096)
            assert rec.flush(30)
    assert [k for k, *_ in _events(service_state)] == ["recorder_started", "node_config", "recorder_closed"]
    monkeypatch.delenv("KVTRAIL_TOKEN")
    with pytest.raises(ValueError, match="token"):
        HttpSink.from_url(url)


def test_a_service_that_never_answers_never_blocks_a_recorder_call():
    """A listener that never accepts: every attempt of the writer stalls for a whole timeout, so a
    recorder call that waited on the service for even one attempt would take at least that long."""
    stall = HttpSinkConfig(connect_timeout_s=0.5, timeout_s=0.5, retries=1, backoff_s=0.01)
    attempt_s = min(stall.connect_timeout_s, stall.timeout_s)
    sock = free_socket()
    sock.listen(1)  # the kernel completes a connection or two; nothing ever reads a request
    try:
        url = "http://127.0.0.1:%d" % sock.getsockname()[1]
        rec = Recorder(HttpSink(url, "kvt_0_x", stall), PRODUCER, RecorderConfig(capacity_events=64))
        slowest = _record(rec, 2000)
        deadline = time.monotonic() + 30
        while rec.stats()["writer_errors_total"] == 0:  # the writer did try, and stalled
            assert time.monotonic() < deadline, rec.stats()
            time.sleep(0.05)
        stats = rec.stats()
        rec.close(timeout=0)
    finally:
        sock.close()
    assert slowest < attempt_s / 2, f"a recorder call took {slowest:.3f} s: it waited on the service"
    assert stats["committed_events_total"] == 0 and stats["dropped_events_total"] > 0


def test_a_stopped_service_never_blocks_the_recorder_and_the_gap_reaches_the_store(service_state):
    token = make_token(service_state)
    sock = free_socket()  # bound, not listening: every connection is refused, as by a stopped service
    url = "http://127.0.0.1:%d" % sock.getsockname()[1]
    rec = Recorder(HttpSink(url, token, FAST), PRODUCER, RecorderConfig(capacity_events=64, flush_interval_s=0.02))
    rec.node_config(pool_tokens=1024, pool_pages=64, page_size=16, context_tokens=4096)
    _record(rec, 2000)  # that no call waits for the service is the next test's
    deadline = time.monotonic() + 30
    while rec.stats()["writer_errors_total"] == 0:
        assert time.monotonic() < deadline, rec.stats()
        time.sleep(0.05)
    # Every event recorded while down is committed, counted lost or held before the service comes back.
    assert rec.flush(60)
    down = rec.stats()
    assert down["dropped_events_total"] > 0 and down["committed_events_total"] == 0
    assert down["buffered_events"] == 0
    # The lost batches held the node's configuration, and the writer holds it (with recorder_started) to
    # go first when the service is back: the node does not report it again, and nothing is refused for
    # an unknown pool size.
    assert down["held_events"] == 2
    with served_in_thread(service_state, sock):  # the service comes back on the same address
        deadline = time.monotonic() + 30
        while not [r for r in _events(service_state) if r[0] == "recorder_gap"]:
            assert time.monotonic() < deadline, rec.stats()
            _record(rec, 1, start=5000)
            time.sleep(0.1)
        rec.close()
    up = rec.stats()
    assert up["invalid_events_total"] == 0 and up["held_events"] == 0, up
    rows = _events(service_state)
    assert [r[0] for r in rows[:2]] == ["recorder_started", "node_config"], rows[:3]
    gaps = [r for r in rows if r[0] == "recorder_gap"]
    assert {r[2] for r in gaps} <= {"buffer_full", "writer_error"} and "writer_error" in {r[2] for r in gaps}
    stored_allocs = sum(1 for r in rows if r[0] == "pages_allocated")
    assert sum(r[3] for r in gaps) >= 2000 - stored_allocs  # every allocation lost while down is counted
    assert rows[-1][0] == "recorder_closed"


class _LoseFirstReply(httpx.BaseTransport):
    """Delivers every request, but the first reply is lost on the way back (as a timeout)."""

    def __init__(self):
        self.inner = httpx.HTTPTransport()
        self.lost = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        reply = self.inner.handle_request(request)
        if not self.lost:
            reply.read()
            reply.close()
            self.lost += 1
            raise httpx.ReadTimeout("reply lost", request=request)
        return reply


def test_a_retry_of_a_committed_batch_is_acknowledged_as_a_duplicate(service_state):
    token = make_token(service_state)
    transport = _LoseFirstReply()
    with served_in_thread(service_state, free_socket()) as url:
        sink = HttpSink(url, token, FAST, transport=transport)
        res = sink.append(from_dicts([config(0), alloc(1, [1, 2])]))
        sink.close()
    assert transport.lost == 1 and sink.retried_requests == 1
    assert (res.num_events, res.num_page_events) == (2, 2)
    assert len(_events(service_state)) == 2 and service_state.committer.duplicates == 1


def _mock(handler) -> httpx.MockTransport:
    return httpx.MockTransport(handler)


def test_422_is_a_validation_error_naming_the_field():
    def handler(request):
        return httpx.Response(
            422,
            json={
                "errors": [
                    {"event": 1, "kind": "pages_allocated", "field": "pages", "reason": "page id 999 out of pool"}
                ]
            },
        )

    sink = HttpSink("http://svc", "t", FAST, transport=_mock(handler))
    with pytest.raises(ValidationError) as err:
        sink.append(from_dicts([config(0)]))
    assert (err.value.event, err.value.kind, err.value.field) == (1, "pages_allocated", "pages")
    assert err.value.events == (1,)  # no list in the reply: the one event it names
    assert sink.sent_requests == 1  # a refused batch is not retried


@pytest.mark.parametrize(
    "listed, believed",
    [([1, 3], (1, 3)), ([1, 9], (1,)), ([1, 1], (1,)), ([3, 1], (1,)), ([1, "3"], (1,)), ("1,3", (1,)), ([2], (1,))],
)
def test_a_refusal_lists_its_events_only_as_positions_of_the_batch(listed, believed):
    """The list comes back as the writer's positions to take out: one that is not ascending positions of
    this batch, starting at the named event, is not believed (the named event alone is taken out)."""

    def handler(request):
        error = {"event": 1, "kind": "pages_allocated", "field": "pages", "reason": "r", "events": listed}
        return httpx.Response(422, json={"errors": [error]})

    sink = HttpSink("http://svc", "t", FAST, transport=_mock(handler))
    with pytest.raises(ValidationError) as err:
        sink.append(from_dicts([config(0), alloc(1, [1]), alloc(2, [2]), alloc(3, [3])]))
    assert err.value.events == believed


def test_the_service_lists_every_refused_event_and_a_writer_takes_them_out_at_once(service_state):
    token = make_token(service_state)
    with served_in_thread(service_state, free_socket()) as url:
        sink = HttpSink(url, token, FAST)
        with pytest.raises(ValidationError) as err:
            sink.append(from_dicts([config(0, pool_pages=8), alloc(1, [9]), alloc(2, [1]), alloc(3, [10])]))
        assert err.value.events == (1, 3) and "pool has 8 pages" in err.value.reason
        writer_sink = HttpSink(url, token, FAST)
        rec = Recorder(writer_sink, PRODUCER, RecorderConfig(flush_interval_s=3600))
        rec.node_config(pool_tokens=1024, pool_pages=64, page_size=16, context_tokens=4096)
        for i in range(500):
            rec.pages_allocated(RequestRef(f"r{i}", tenant_id="acme"), [1 + i % 2 * 100], "decode_growth")
        assert rec.flush(60)
        stats = rec.stats()
        rec.close()
    assert stats["invalid_events_total"] == 250, stats
    # refused, committed without them, the gap event, recorder_closed (one try per bad event: 253)
    assert writer_sink.sent_requests == 4
    rows = _events(service_state)
    assert sum(1 for r in rows if r[0] == "pages_allocated") == 250
    (gap,) = [r for r in rows if r[0] == "recorder_gap"]
    assert gap[2:] == ("invalid", 250)


def test_5xx_and_transport_errors_are_retried_then_a_store_error():
    calls = []

    def handler(request):
        calls.append(request)
        if len(calls) == 1:
            raise httpx.ConnectError("refused", request=request)
        if len(calls) == 2:
            return httpx.Response(503, json={"detail": "store failed"})
        return httpx.Response(
            200,
            json={
                "producer_id": 7,
                "batch_no": 3,
                "first_seq": 0,
                "last_seq": 0,
                "events": 1,
                "page_events": 0,
                "digest": "00",
                "duplicate": False,
            },
        )

    sink = HttpSink("http://svc", "t", FAST, transport=_mock(handler))
    assert sink.append(from_dicts([config(0)])).batches == ((7, 3),)
    assert len(calls) == 3 and calls[0].headers["authorization"] == "Bearer t"

    always = HttpSink("http://svc", "t", FAST, transport=_mock(lambda r: httpx.Response(500, text="boom")))
    with pytest.raises(StoreError, match="unavailable after 3 attempts: HTTP 500"):
        always.append(from_dicts([config(0)]))
    refused = HttpSink("http://svc", "t", FAST, transport=_mock(lambda r: httpx.Response(403, json={"detail": "no"})))
    with pytest.raises(StoreError, match="HTTP 403: no"):
        refused.append(from_dicts([config(0)]))


def test_413_splits_the_batch(service_state):
    token = make_token(service_state)
    table = from_dicts([config(0)] + [alloc(i, [1, 2, 3]) for i in range(1, 40)])
    halves = [len(write_ipc(wire_table(table.slice(k * 20, 20)))) for k in range(2)]
    limit = max(halves)  # each half (as sent) is within it, the whole batch over it
    assert len(write_ipc(wire_table(table))) > limit
    with served_in_thread(service_state, free_socket()) as url:
        sizes = []

        class Limit(httpx.BaseTransport):
            inner = httpx.HTTPTransport()

            def handle_request(self, request):
                sizes.append(len(request.content))
                if len(request.content) > limit:
                    return httpx.Response(413, json={"detail": "too large"})
                return self.inner.handle_request(request)

        sink = HttpSink(url, token, FAST, transport=Limit())
        res = sink.append(table)
        sink.close()
    assert res.num_events == 40 and len(res.batches) == 2 and sizes[0] > limit
    assert len(_events(service_state)) == 40


class _RowLimit(httpx.BaseTransport):
    """A service whose body limit holds ``limit`` events (413 above it); the next ``fail`` requests after
    the first one it passes on fail as a connection refused."""

    def __init__(self, limit: int, fail: int = 0):
        self.inner = httpx.HTTPTransport()
        self.limit, self.fail = limit, fail
        self.rows: list[int] = []
        self.passed = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        rows = read_ipc(request.content).num_rows
        self.rows.append(rows)
        if rows > self.limit:
            return httpx.Response(413, json={"detail": "too large"})
        if self.passed and self.fail:
            self.fail -= 1
            raise httpx.ConnectError("refused", request=request)
        self.passed += 1
        return self.inner.handle_request(request)


def _split_scenario(service_state, transport: _RowLimit, bad_at: int | None) -> dict:
    """A recorder whose one batch (recorder_started, node_config, 100 allocations) is split in two by 413."""
    token = make_token(service_state)
    with served_in_thread(service_state, free_socket()) as url:
        rec = Recorder(HttpSink(url, token, FAST, transport=transport), PRODUCER, RecorderConfig(flush_interval_s=3600))
        rec.node_config(pool_tokens=1024, pool_pages=64, page_size=16, context_tokens=4096)
        for i in range(100):
            page = 200 if i == bad_at else 1 + i % 60  # 200: beyond the pool
            rec.pages_allocated(RequestRef(f"r{i}", tenant_id="acme"), [page], "decode_growth")
        assert rec.flush(60)
        stats = rec.stats()
        rec.close()
    return stats


def test_a_split_batch_whose_second_part_is_refused_is_stored_once_without_its_bad_event(service_state):
    transport = _RowLimit(60)
    stats = _split_scenario(service_state, transport, bad_at=80)
    rows = _events(service_state)
    allocs = [r[1] for r in rows if r[0] == "pages_allocated"]
    assert len(allocs) == len(set(allocs)) == 99 and 82 not in allocs  # seq 82: allocation 80
    assert stats["invalid_events_total"] == 1 and stats["writer_errors_total"] == 0, stats
    # 102 events, split 51 / 51; the second refused; sent again without its bad event and without the
    # committed first half (50); then the gap event counting the refusal, and recorder_closed.
    assert transport.rows == [102, 51, 51, 50, 1, 1], transport.rows
    assert stats["committed_events_total"] == 102 == len(rows) - 1  # every stored event but recorder_closed


def test_a_split_batch_whose_second_part_fails_is_retried_without_the_committed_part(service_state):
    transport = _RowLimit(60, fail=FAST.retries + 1)  # the second half fails every attempt of the sink
    stats = _split_scenario(service_state, transport, bad_at=None)
    rows = _events(service_state)
    assert [r[1] for r in rows] == list(range(103)), rows  # every event once, recorder_closed last
    assert stats["writer_errors_total"] == 0 and stats["committed_events_total"] == 102, stats
    assert transport.rows[:5] == [102, 51, 51, 51, 51] and transport.rows[5] == 51, transport.rows


def test_a_url_is_required():
    with pytest.raises(ValueError, match="url"):
        HttpSink("svc:8080", "t")
