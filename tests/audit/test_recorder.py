"""The recorder: every call lands in the store, losses are counted and visible, the caller never sees an error."""

import threading

import numpy as np
import pytest

from kvtrail.audit.events import Producer, RequestRef
from kvtrail.audit.recorder import Recorder, RecorderConfig
from kvtrail.audit.store import AuditStore
from kvtrail.audit.verify import verify_store
from kvtrail.errors import ValidationError
from tests.conftest import stored_events

PROD = Producer("c1", "decode-0", "decode", "kvtrail-reference", "0.1", "inst-1")
REQ = RequestRef("r1", 77, "acme", "k:1")


def _config(rec, pool_pages=128):
    rec.node_config(
        pool_tokens=pool_pages * 16,
        pool_pages=pool_pages,
        page_size=16,
        context_tokens=4096,
        deferred_release=True,
        config_source="test",
        release_timeout_ns=30 * 10**9,
        transfer_batch_max_pages=64,
    )


def test_every_method_lands_with_its_fields(tmp_path):
    path = tmp_path / "a.duckdb"
    with Recorder(path, PROD) as rec:
        _config(rec)
        rec.request_received(REQ, prompt_tokens=100, max_new_tokens=8)
        rec.pages_allocated(REQ, np.array([3, 4, 5], dtype=np.int32), "decode_reservation")
        rec.pages_allocated(REQ, [9], "prefix_hit", block_hashes=[-5])
        rec.transfer_reserved(REQ, range(3, 6), num_tokens=100)
        rec.transfer_received(REQ, [3, 4, 5], num_tokens=100, status="ok", digest=2**64 - 1, digest_algo="adler32")
        rec.kv_written(REQ, [3, 4, 5], 0, 100, "transfer_in", page_digests=np.array([1, 2, 3], dtype=np.uint64))
        rec.kv_read(REQ, [3, 4, 5, 9])
        rec.transfer_sent(REQ, [1], [3], num_tokens=1, is_last_chunk=True)
        rec.request_aborted(REQ, "decode", "transfer length mismatch", 500, prompt_tokens=100)
        rec.response_sent(REQ, 500, 100, 0, latency_ns=10, ttft_ns=None, finish_reason="abort")
        rec.pages_freed(REQ, [3, 4, 5], "deferred_release")
        rec.pages_freed(None, [9], "eviction")
        assert rec.flush(10)
    evs = stored_events(path)
    assert [e["seq"] for e in evs] == list(range(15))  # recorder_started, 13, recorder_closed
    by_kind = {}
    for e in evs:
        by_kind.setdefault(e["kind"], []).append(e)
    assert by_kind["node_config"][0]["deferred_release"] is True
    assert (by_kind["node_config"][0]["release_timeout_ns"], by_kind["node_config"][0]["transfer_batch_max_pages"]) == (
        30 * 10**9,
        64,
    )
    assert by_kind["pages_allocated"][0]["pages"] == [3, 4, 5]
    assert by_kind["pages_allocated"][1]["block_hashes"] == [-5]
    assert by_kind["transfer_reserved"][0]["pages"] == [3, 4, 5]
    assert by_kind["transfer_received"][0]["digest"] == 2**64 - 1
    assert by_kind["kv_written"][0]["page_digests"] == [1, 2, 3]
    assert by_kind["transfer_sent"][0]["dst_pages"] == [3]
    assert by_kind["request_aborted"][0]["abort_reason"] == "transfer length mismatch"
    assert by_kind["response_sent"][0]["http_status"] == 500
    assert "request" not in by_kind["pages_freed"][1]
    assert by_kind["kv_read"][0]["request"] == {
        "request_id": "r1",
        "transfer_id": 77,
        "tenant_id": "acme",
        "api_key_id": "k:1",
    }
    walls = [e["wall_ns"] for e in evs]
    assert walls == sorted(walls) and all(w > 1_700_000_000 * 10**9 for w in walls)


def test_caller_buffer_reuse_does_not_change_what_was_recorded(tmp_path):
    path = tmp_path / "a.duckdb"
    pages = np.array([1, 2, 3], dtype=np.int32)
    plist = [4, 5]
    with Recorder(path, PROD) as rec:
        _config(rec)
        rec.pages_allocated(REQ, pages, "decode_growth")
        rec.pages_allocated(REQ, plist, "decode_growth")
        pages[:] = 99
        plist.append(100)
    got = [e["pages"] for e in stored_events(path) if e["kind"] == "pages_allocated"]
    assert got == [[1, 2, 3], [4, 5]]


class BlockingSink:
    """Wraps a store; the first append waits until released, so the recorder's buffer fills."""

    def __init__(self, path):
        self.store = AuditStore(path)
        self.release = threading.Event()
        self.entered = threading.Event()

    def append(self, table):
        self.entered.set()
        self.release.wait(30)
        return self.store.append(table)

    def close(self):
        self.store.close()


def test_full_buffer_drops_are_counted_and_become_a_gap_event(tmp_path):
    path = tmp_path / "a.duckdb"
    sink = BlockingSink(path)
    rec = Recorder(sink, PROD, RecorderConfig(capacity_events=50, flush_interval_s=0.005))
    _config(rec)
    assert sink.entered.wait(10)  # the writer is now stuck inside append with the config event
    for i in range(500):
        rec.pages_allocated(REQ, [1 + i % 100], "decode_growth")
    assert rec.stats()["dropped_events_total"] == 450
    sink.release.set()
    assert rec.flush(30)
    rec.close()
    evs = stored_events(path)
    gaps = [e for e in evs if e["kind"] == "recorder_gap"]
    assert len(gaps) == 1 and gaps[0]["dropped_events"] == 450 and gaps[0]["dropped_pages"] == 450
    assert gaps[0]["gap_reason"] == "buffer_full"
    report = verify_store(path)
    assert report.ok
    (cov,) = report.coverage
    assert cov.missing_events == 450 and cov.explained_by_gaps == 450 and cov.unexplained == 0


def test_invalid_events_are_isolated_counted_and_good_ones_kept(tmp_path):
    path = tmp_path / "a.duckdb"
    with Recorder(path, PROD) as rec:
        _config(rec, pool_pages=16)
        rec.pages_allocated(REQ, [1, 2], "decode_growth")
        rec.pages_allocated(REQ, [17], "decode_growth")  # beyond the pool
        rec.pages_allocated(REQ, [3], "not-a-purpose")
        rec.transfer_reserved(REQ, [4], num_tokens="many")  # wrong type
        rec.pages_allocated(REQ, [5, 6], "decode_growth")
        assert rec.flush(10)
        assert rec.stats()["invalid_events_total"] == 3
    evs = stored_events(path)
    assert [e["pages"] for e in evs if e["kind"] == "pages_allocated"] == [[1, 2], [5, 6]]
    (gap,) = [e for e in evs if e["kind"] == "recorder_gap"]
    assert gap["gap_reason"] == "invalid" and gap["dropped_events"] == 3
    assert "pages" in gap["detail"] and "pool has 16 pages" in gap["detail"]
    report = verify_store(path)
    assert report.ok and report.coverage[0].unexplained == 0


class FailingSink:
    def __init__(self):
        self.calls = 0

    def append(self, table):
        self.calls += 1
        raise OSError("disk full")


def test_a_failing_store_never_reaches_the_caller(tmp_path, monkeypatch):
    monkeypatch.setattr("kvtrail.audit.writer._RETRY_DELAYS_S", (0.0, 0.0))
    sink = FailingSink()
    rec = Recorder(sink, PROD, RecorderConfig(flush_interval_s=0.005))
    for _ in range(20):
        rec.pages_allocated(REQ, [1], "decode_growth")
    assert rec.flush(10)
    stats = rec.stats()
    assert stats["writer_errors_total"] >= 20 and stats["committed_events_total"] == 0
    assert sink.calls >= 3  # first try plus retries
    rec.close()


def test_garbage_arguments_never_raise(tmp_path):
    path = tmp_path / "a.duckdb"
    with Recorder(path, PROD) as rec:
        _config(rec)
        rec.pages_allocated(REQ, None, "decode_growth")
        rec.pages_allocated(REQ, object(), "decode_growth")
        rec.kv_read(None, [1])
        rec.pages_allocated(REQ, [2], "decode_growth")
        assert rec.flush(10)
        s = rec.stats()
    assert s["invalid_events_total"] + s["internal_errors_total"] == 3
    assert [e["pages"] for e in stored_events(path) if e["kind"] == "pages_allocated"] == [[2]]


def test_concurrent_threads_keep_sequence_contiguous(tmp_path):
    path = tmp_path / "a.duckdb"
    rec = Recorder(path, PROD, RecorderConfig(flush_interval_s=0.001))
    _config(rec)

    def work(t):
        for i in range(2000):
            rec.pages_allocated(RequestRef(f"r{t}-{i}"), [1 + (i % 100), 101], "decode_growth")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rec.close()
    report = verify_store(path)
    assert report.ok
    (cov,) = report.coverage
    assert cov.stored_events == 8003 and cov.missing_events == 0  # with recorder_started/_closed


def test_close_is_idempotent_and_flush_after_close_returns_false(tmp_path):
    rec = Recorder(tmp_path / "a.duckdb", PROD)
    _config(rec)
    rec.close()
    rec.close()
    assert rec.flush(0.1) is False
    rec.pages_allocated(REQ, [1], "decode_growth")  # still never raises


def test_bad_config_is_a_value_error():
    with pytest.raises(ValueError, match="capacity_events"):
        RecorderConfig(capacity_events=0)


def test_kv_written_carries_the_block_hashes_the_writer_stored(tmp_path):
    path = tmp_path / "a.duckdb"
    with Recorder(path, PROD) as rec:
        _config(rec)
        rec.kv_written(REQ, [3, 4], 0, 32, "forward", block_hashes=np.array([-7, 2**62], dtype=np.int64))
        rec.kv_written(REQ, [5], 32, 48, "forward")
        assert rec.flush(10)
    written = [e for e in stored_events(path) if e["kind"] == "kv_written"]
    assert written[0]["block_hashes"] == [-7, 2**62] and "block_hashes" not in written[1]


class OutageSink:
    """A store that commits ``ok_first`` appends, fails the next ``failures`` (an outage), then commits."""

    def __init__(self, path, ok_first: int, failures: int):
        self.store = AuditStore(path)
        self.ok_first, self.failures = ok_first, failures

    def append(self, table):
        if self.ok_first > 0:
            self.ok_first -= 1
        elif self.failures > 0:
            self.failures -= 1
            raise OSError("store unreachable")
        return self.store.append(table)

    def close(self):
        self.store.close()


def test_gap_accounting_after_an_outage_counts_each_lost_event_once(tmp_path, monkeypatch):
    monkeypatch.setattr("kvtrail.audit.writer._RETRY_DELAYS_S", (0.0,))
    path = tmp_path / "a.duckdb"
    sink = OutageSink(path, ok_first=1, failures=8)  # then four failed commits (each: a try and one retry)
    rec = Recorder(sink, PROD, RecorderConfig(flush_interval_s=3600))
    _config(rec)
    assert rec.flush(10)  # recorder_started and node_config stored
    sent = 0
    for burst in (5, 3):  # two flushes during the outage; gap events of the first are lost in the second
        for i in range(burst):
            rec.pages_allocated(RequestRef(f"r{sent + i}"), [1 + i], "decode_growth")
        sent += burst
        assert rec.flush(10)
    rec.pages_allocated(REQ, [50], "decode_growth")  # after the outage: committed, with the pending gaps
    assert rec.flush(10)
    stats = rec.stats()
    rec.close()
    report = verify_store(path)
    (cov,) = report.coverage
    assert cov.unexplained == 0 and cov.missing_events == cov.explained_by_gaps, cov
    stored = {e["kind"] for e in stored_events(path)}
    assert "recorder_gap" in stored
    assert cov.missing_events == sent + 3  # the 8 allocations and the 3 gap events lost with them
    assert stats["writer_errors_total"] == sent  # the caller's own events lost: each once


def test_an_outage_at_start_keeps_the_configuration_so_later_events_land(tmp_path, monkeypatch):
    """The first batch (recorder_started, node_config, allocations) is lost: the framing and the
    configuration are held and go first in the next batch, so nothing after the outage is refused for an
    unknown pool size, and the store's count of missing events is exactly what the gap events explain."""
    monkeypatch.setattr("kvtrail.audit.writer._RETRY_DELAYS_S", (0.0,))
    path = tmp_path / "a.duckdb"
    # Four failed commits, each a try and one retry: a flush's batch, then its gap event, twice over.
    sink = OutageSink(path, ok_first=0, failures=8)
    rec = Recorder(sink, PROD, RecorderConfig(flush_interval_s=3600))
    _config(rec, pool_pages=96)
    for i in range(3):
        rec.pages_allocated(RequestRef(f"lost{i}"), [1 + i], "decode_growth")
    assert rec.flush(10)
    assert rec.stats()["held_events"] == 2 and rec.stats()["writer_errors_total"] == 3
    _config(rec, pool_pages=128)  # a newer configuration supersedes the held one; both lost with it
    rec.pages_allocated(RequestRef("lost3"), [4], "decode_growth")
    assert rec.flush(10)
    assert rec.stats()["held_events"] == 2 and rec.stats()["writer_errors_total"] == 5
    rec.pages_allocated(REQ, [120], "decode_growth")  # within the held pool of 128, not the first one's 96
    assert rec.flush(10)
    stats = rec.stats()
    rec.close()
    assert stats["invalid_events_total"] == 0 and stats["held_events"] == 0, stats
    assert stats["writer_errors_total"] == 5  # the 4 allocations and the superseded configuration
    events = stored_events(path)
    kinds = [e["kind"] for e in events]
    assert kinds[:2] == ["recorder_started", "node_config"], kinds
    assert events[0]["seq"] == 0 and events[1]["pool_pages"] == 128 and events[1]["seq"] == 6
    assert [e["pages"] for e in events if e["kind"] == "pages_allocated"] == [[120]]
    report = verify_store(path)
    (cov,) = report.coverage
    # Missing: the 5 events above and the three gap events lost with the second to fourth commits.
    assert cov.unexplained == 0 and cov.missing_events == cov.explained_by_gaps == 5 + 3, cov


def test_held_events_go_alone_when_nothing_else_is_buffered(tmp_path, monkeypatch):
    """An idle node whose only batch was lost: its framing and configuration land at the next cycle that
    finds the store up, without waiting for the node's next event."""
    monkeypatch.setattr("kvtrail.audit.writer._RETRY_DELAYS_S", (0.0,))
    path = tmp_path / "a.duckdb"
    sink = OutageSink(path, ok_first=0, failures=2)
    rec = Recorder(sink, PROD, RecorderConfig(flush_interval_s=3600))
    _config(rec)
    assert rec.flush(10)
    assert rec.stats()["held_events"] == 2 and rec.stats()["committed_events_total"] == 0
    assert rec.flush(10)  # a cycle with nothing buffered: the held events alone
    stats = rec.stats()
    rec.close()
    assert stats["held_events"] == 0 and stats["committed_events_total"] == 2 and stats["writer_errors_total"] == 0
    assert [e["kind"] for e in stored_events(path)] == ["recorder_started", "node_config", "recorder_closed"]


class UnsaidRefusalSink(OutageSink):
    """Refuses its first batch without saying which events broke the rule (a service of an older release),
    then fails ``failures`` appends (the store goes down meanwhile), then commits."""

    def __init__(self, path, failures: int):
        super().__init__(path, ok_first=0, failures=failures)
        self.refused = False

    def append(self, table):
        if not self.refused:
            self.refused = True
            raise ValidationError("(batch)", "refused, positions not said")
        return super().append(table)


def test_an_outage_while_isolating_a_refused_batch_keeps_the_configuration(tmp_path, monkeypatch):
    """A refusal that names no event sends the batch's events one at a time; the store fails on the first
    (and its retry): the rest is a failed batch, the framing and configuration held, the allocations lost,
    and what the node records afterwards lands (not refused for an unknown pool size)."""
    monkeypatch.setattr("kvtrail.audit.writer._RETRY_DELAYS_S", (0.0,))
    path = tmp_path / "a.duckdb"
    sink = UnsaidRefusalSink(path, failures=2)
    rec = Recorder(sink, PROD, RecorderConfig(flush_interval_s=3600))
    _config(rec)
    for i in range(2):
        rec.pages_allocated(RequestRef(f"lost{i}"), [1 + i], "decode_growth")
    assert rec.flush(10)
    rec.pages_allocated(REQ, [7], "decode_growth")
    assert rec.flush(10)
    stats = rec.stats()
    rec.close()
    assert stats["held_events"] == 0 and stats["invalid_events_total"] == 0, stats
    assert stats["writer_errors_total"] == 2  # the two allocations, counted once each
    events = stored_events(path)
    assert [e["kind"] for e in events][:2] == ["recorder_started", "node_config"]
    assert [e["pages"] for e in events if e["kind"] == "pages_allocated"] == [[7]]
    (cov,) = verify_store(path).coverage
    assert cov.unexplained == 0 and cov.missing_events == cov.explained_by_gaps == 2, cov


def test_held_events_count_as_lost_when_the_writer_stops_with_the_store_down(monkeypatch):
    monkeypatch.setattr("kvtrail.audit.writer._RETRY_DELAYS_S", (0.0,))
    sink = FailingSink()
    rec = Recorder(sink, PROD, RecorderConfig(flush_interval_s=3600))
    _config(rec)
    rec.pages_allocated(REQ, [1], "decode_growth")
    assert rec.flush(10)
    assert rec.stats()["held_events"] == 2 and rec.stats()["writer_errors_total"] == 1
    rec.close()
    stats = rec.stats()
    # Lost: the allocation, recorder_closed, and the two held events, counted when the writer stopped.
    assert stats["held_events"] == 0 and stats["writer_errors_total"] == 4 and stats["committed_events_total"] == 0


class CountingSink:
    """An AuditStore that counts the batches it is asked to append (refused ones included)."""

    def __init__(self, path):
        self.store = AuditStore(path)
        self.calls = 0

    def append(self, table):
        self.calls += 1
        return self.store.append(table)

    def close(self):
        self.store.close()


def test_a_node_whose_every_page_event_is_refused_costs_the_writer_one_more_try_not_one_per_event(tmp_path):
    """A producer that never reports its configuration: the store refuses every event with pages. The
    refusal lists them all, so the writer takes them out together; the rest of the batch still lands."""
    path = tmp_path / "a.duckdb"
    sink = CountingSink(path)
    rec = Recorder(sink, PROD, RecorderConfig(flush_interval_s=3600))
    for i in range(3000):
        rec.pages_allocated(RequestRef(f"r{i}"), [1 + i % 50], "decode_growth")
        if i % 1000 == 0:
            rec.request_received(RequestRef(f"q{i}", tenant_id="acme"), prompt_tokens=8)
    assert rec.flush(60)
    stats = rec.stats()
    calls = sink.calls
    rec.close()
    # The batch refused, the batch without them, then the gap event counting them (one per bad event: 3002).
    assert stats["invalid_events_total"] == 3000 and calls == 3, (stats, calls)
    evs = stored_events(path)
    assert [e["kind"] for e in evs].count("request_received") == 3
    (gap,) = [e for e in evs if e["kind"] == "recorder_gap"]
    assert gap["gap_reason"] == "invalid" and gap["dropped_events"] == 3000
    assert "pool size unknown" in gap["detail"]
    (cov,) = verify_store(path).coverage
    assert cov.unexplained == 0 and cov.missing_events == 3000
