"""The recorder-writer hand-off: numbering, bounded capacity, counted drops, gap events, flush markers."""

import threading

from kvtrail.audit.buffer import GAP_CODE, EventBuffer, gap_payload
from kvtrail.audit.events import KIND_CODES, PAYLOAD_LAYOUT

ALLOC = KIND_CODES["pages_allocated"]


def test_put_numbers_events_and_drain_takes_them_in_order():
    buf = EventBuffer(10)
    for i in range(3):
        buf.put(ALLOC, None, (i,), None, ("decode_growth", None))
    assert len(buf) == 3 and buf.next_seq == 3
    items, markers = buf.drain([])
    assert [it[1] for it in items] == [0, 1, 2] and [it[4] for it in items] == [(0,), (1,), (2,)]
    assert markers == [] and len(buf) == 0


def test_a_full_buffer_drops_counts_and_reports_one_gap_event_with_the_next_seq():
    buf = EventBuffer(2)
    for _ in range(5):
        buf.put(ALLOC, None, (1, 2, 3), None, ("decode_growth", None))
    assert len(buf) == 2 and buf.total_dropped == 3 and buf.next_seq == 5
    items, _ = buf.drain([])
    assert [it[1] for it in items] == [0, 1, 5]
    gap = items[-1]
    assert gap[0] == GAP_CODE and gap[3:6] == (None, None, None)
    fields = dict(zip(PAYLOAD_LAYOUT["recorder_gap"], gap[6]))
    assert fields["gap_reason"] == "buffer_full" and fields["dropped_events"] == 3 and fields["dropped_pages"] == 9
    assert "capacity 2" in fields["detail"]
    assert buf.drain([])[0] == []  # the drop count was reset with the gap event; the total stays
    assert buf.total_dropped == 3


def test_writer_gap_rows_become_gap_events_and_the_list_is_emptied():
    buf = EventBuffer(4)
    rows = [("invalid", 2, 0, "bad page"), ("writer_error", 5, 7, "disk full")]
    items, _ = buf.drain(rows)
    assert rows == []
    assert [it[6] for it in items] == [
        gap_payload("invalid", 2, 0, "bad page"),
        gap_payload("writer_error", 5, 7, "disk full"),
    ]
    assert [it[1] for it in items] == [0, 1]


def test_gap_payload_follows_the_registry_order():
    payload = gap_payload("transport", 4, 8, "relay gone")
    assert dict(zip(PAYLOAD_LAYOUT["recorder_gap"], payload)) == {
        "gap_reason": "transport",
        "dropped_events": 4,
        "dropped_pages": 8,
        "detail": "relay gone",
    }


def test_flush_markers_bypass_capacity_and_come_back_separately():
    buf = EventBuffer(1)
    buf.put(ALLOC, None, (1,), None, ("decode_growth", None))
    marker = threading.Event()
    buf.mark(marker)
    items, markers = buf.drain([])
    assert markers == [marker] and [it[1] for it in items] == [0]


def test_put_never_raises_and_counts_what_went_wrong():
    buf = EventBuffer(1)
    buf.put(ALLOC, None, (1,), None, ("decode_growth", None))
    buf.put(ALLOC, None, object(), None, ("decode_growth", None))  # full, and the pages have no length
    assert buf.internal_errors == 1 and buf.next_seq == 2
