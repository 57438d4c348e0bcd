"""The recorder snapshots a 1-D ndarray of page ids as its bytes (its dtype beside them in the buffered
tuple) instead of copying it. The writer reads the snapshots back: the batch is the one the copies
build, whatever the mix of dtypes, lists and page-less events; a snapshot of non-integers is refused at
its own row; drops and losses count pages, not bytes."""

import numpy as np
import pytest

import kvtrail.audit.writer as writer
from kvtrail.audit.buffer import EventBuffer
from kvtrail.audit.events import KIND_CODES, PAYLOAD_LAYOUT, Producer, RequestRef
from kvtrail.audit.recorder import Recorder
from kvtrail.errors import ValidationError
from tests.conftest import stored_events

PROD = Producer("c1", "decode-0", "decode", "kvtrail-reference", "0.1", "decode-1")
REQ = RequestRef("r1", 77, "acme", "k:1")
ALLOC, SENT, RESP = KIND_CODES["pages_allocated"], KIND_CODES["transfer_sent"], KIND_CODES["response_sent"]


def _payload(kind: str, **values) -> tuple:
    return tuple(values.get(name) for name in PAYLOAD_LAYOUT[kind])


def _events(rng, n: int, dtypes) -> list:
    """(code, pages, dst, payload) per event: page-list events in the given dtypes (or lists), transfers
    with dst lists, page-less responses, empty arrays."""
    out = []
    for _ in range(n):
        pick = rng.integers(0, 10)
        ids = rng.integers(1, 5000, size=int(rng.integers(0, 70)))
        if pick < 6:
            dt = dtypes[int(rng.integers(0, len(dtypes)))]
            pages = ids.tolist() if dt is list else ids.astype(dt)
            out.append((ALLOC, pages, None, _payload("pages_allocated", purpose="decode_growth")))
        elif pick < 8:
            out.append(
                (
                    SENT,
                    tuple(ids.tolist()),
                    ids[::-1].astype(np.int32),
                    _payload("transfer_sent", num_tokens=4, is_last_chunk=True),
                )
            )
        else:
            out.append(
                (
                    RESP,
                    None,
                    None,
                    _payload("response_sent", http_status=200, prompt_tokens=1, completion_tokens=1, latency_ns=5),
                )
            )
    return out


def _items(events, snapshot: bool) -> list:
    buf = EventBuffer(100_000)
    for code, pages, dst, payload in events:
        if snapshot and type(pages) is np.ndarray and code == ALLOC:
            buf.put(code, REQ, pages.tobytes(), pages.dtype, payload)
        else:
            buf.put(code, REQ, pages.copy() if type(pages) is np.ndarray else pages, dst, payload)
    items, _ = buf.drain([])
    return [it[:2] + (0,) + it[3:] for it in items]  # one clock for both forms


@pytest.mark.parametrize(
    "dtypes",
    [(np.int32,), (np.int64,), (np.uint32,), (np.int32, np.int64, list), (np.int16, np.uint64, np.int32)],
    ids=str,
)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_snapshots_build_the_batch_copies_build(dtypes, seed):
    events = _events(np.random.default_rng(seed), 300, dtypes)
    want = writer.build_batch(PROD, _items(events, snapshot=False), 0)
    got = writer.build_batch(PROD, _items(events, snapshot=True), 0)
    assert got.equals(want)
    pages = got.column("pages").to_pylist()
    assert sum(len(p or []) for p in pages) > 1000 and any(p is None for p in pages)
    assert got.column("dst_pages").null_count == sum(code != SENT for code, *_ in events)


def test_a_snapshot_of_non_integers_is_refused_at_its_row():
    events = _events(np.random.default_rng(5), 40, (np.int32,))
    events.insert(17, (ALLOC, np.array([1.5, 2.0]), None, _payload("pages_allocated", purpose="decode_growth")))
    with pytest.raises(ValidationError) as err:
        writer.build_batch(PROD, _items(events, snapshot=True), 0)
    assert err.value.field == "pages" and err.value.event == 17 and "float64" in err.value.reason


def test_drops_and_losses_count_a_snapshot_in_pages():
    buf = EventBuffer(1)
    pages = np.arange(7, dtype=np.int64)
    for _ in range(3):
        buf.put(ALLOC, REQ, pages.tobytes(), pages.dtype, _payload("pages_allocated", purpose="decode_growth"))
    assert buf.total_dropped == 2 and buf.dropped_pages == 14
    items, _ = buf.drain([])
    assert writer._lost_counts(items[:1]) == (1, 7, 1)


def test_the_recorder_snapshots_what_the_caller_passed_and_isolates_bad_arrays(tmp_path):
    path = tmp_path / "a.duckdb"
    i32, i64 = np.array([1, 2, 3], np.int32), np.array([40, 41], np.int64)
    with Recorder(path, PROD) as rec:
        rec.node_config(pool_tokens=128 * 16, pool_pages=128, page_size=16, context_tokens=4096, config_source="test")
        rec.pages_allocated(REQ, i32, "decode_growth")
        rec.kv_written(REQ, i64, 0, 32, "forward")
        rec.kv_read(REQ, i32[::-1])  # a strided view: its bytes are the ids in view order
        rec.pages_allocated(REQ, np.array([5.0, 6.0]), "decode_growth")  # not integers: refused alone
        rec.pages_allocated(REQ, np.array([[7, 8]], np.int32), "decode_growth")  # 2-D: refused alone
        rec.pages_freed(REQ, i64, "finish")
        i32[:] = 99  # the caller reuses its buffers: what was recorded stays
        i64[:] = 99
        assert rec.flush(10)
        assert rec.stats()["invalid_events_total"] == 2
    got = [(e["kind"], e["pages"]) for e in stored_events(path) if e.get("pages") is not None]
    assert got == [
        ("pages_allocated", [1, 2, 3]),
        ("kv_written", [40, 41]),
        ("kv_read", [3, 2, 1]),
        ("pages_freed", [40, 41]),
    ]
