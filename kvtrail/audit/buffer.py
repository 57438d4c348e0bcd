"""The hand-off between a recorder and its writer thread: a bounded buffer of event tuples.

The recorder's hot path hands :meth:`EventBuffer.put` one event at a time; it is buffered as the tuple
``(kind_code, seq, mono_ns, request, pages, dst_pages, payload)``, with ``payload`` laid out as
:data:`kvtrail.audit.events.PAYLOAD_LAYOUT` says for the kind. ``pages`` may be a 1-D ndarray's bytes,
its dtype then in the ``dst_pages`` slot (the page kinds have no dst_pages list): the writer reads it
back with :func:`kvtrail.audit.writer.page_snapshots`. The writer takes everything at once
with :meth:`EventBuffer.drain`. The buffer numbers the events, so a dropped event still consumes its
sequence number and the store can prove how many are missing; drops are counted here and come back
out of ``drain`` as ``recorder_gap`` events. Neither side imports the other: both import this module.

The buffer also frames an instance's events: :meth:`EventBuffer.begin` reserves seq 0 for a
``recorder_started`` event (committed with the first batch that has events, so an idle recorder
writes nothing), and after :meth:`EventBuffer.end` the next drain closes with a ``recorder_closed``
event whose seq is the instance's last.
"""

from __future__ import annotations

import threading
from collections import deque
from time import monotonic_ns

from kvtrail.audit.events import KIND_CODES, PAYLOAD_LAYOUT

GAP_CODE = KIND_CODES["recorder_gap"]
STARTED_CODE = KIND_CODES["recorder_started"]
CLOSED_CODE = KIND_CODES["recorder_closed"]
_GAP_LAYOUT = PAYLOAD_LAYOUT["recorder_gap"]
# Where a gap event's payload keeps its counts (the writer reads them back when a gap event is lost).
GAP_EVENTS_AT = _GAP_LAYOUT.index("dropped_events")
GAP_PAGES_AT = _GAP_LAYOUT.index("dropped_pages")

GapRow = tuple[str, int, int, str]  # (gap_reason, dropped_events, dropped_pages, detail)


def gap_payload(reason: str, events: int, pages: int, detail: str) -> tuple:
    """The payload tuple of a ``recorder_gap`` event, in the registry's field order."""
    values = {"gap_reason": reason, "dropped_events": events, "dropped_pages": pages, "detail": detail}
    return tuple(values[name] for name in _GAP_LAYOUT)


def _payload(kind: str, **values) -> tuple:
    """The payload tuple of a ``kind`` event from keyword values, in the registry's field order."""
    return tuple(values.get(name) for name in PAYLOAD_LAYOUT[kind])


class EventBuffer:
    """Event tuples of one producer between the recording threads and the one writer thread.

    ``put`` is safe to call from any thread and never raises; past ``capacity_events`` buffered
    events it drops the event and counts it (and its pages).
    """

    def __init__(self, capacity_events: int):
        assert capacity_events >= 1, "EventBuffer capacity must be >= 1 (RecorderConfig checks it)"
        self.capacity_events = capacity_events
        self._lock = threading.Lock()
        self._buf: deque = deque()
        self._seq = 0
        self.dropped_events = 0  # since the last gap event
        self.dropped_pages = 0
        self.total_dropped = 0
        self.internal_errors = 0  # exceptions caught inside put
        self._started: tuple | None = None  # the recorder_started event until a drain hands it out
        self._ending = False

    @property
    def next_seq(self) -> int:
        """Sequence number of the next event: how many this producer has numbered (recorded or dropped)."""
        return self._seq

    def __len__(self) -> int:
        return len(self._buf)

    def put(self, code: int, req, pages, dst, payload: tuple) -> None:
        # Only the monotonic clock is read here; the writer derives wall_ns from it with a wall-clock
        # offset it re-reads at every drain, which saves a clock read per event.
        try:
            lock = self._lock
            lock.acquire()
            try:
                seq = self._seq
                self._seq = seq + 1
                buf = self._buf
                if len(buf) < self.capacity_events:
                    buf.append((code, seq, monotonic_ns(), req, pages, dst, payload))
                else:
                    self.dropped_events += 1
                    self.total_dropped += 1
                    if pages is not None:  # an ndarray snapshot is its bytes, its dtype in the dst slot
                        self.dropped_pages += len(pages) // dst.itemsize if type(pages) is bytes else len(pages)
            finally:
                lock.release()
        except Exception:  # noqa: BLE001 - the serving path must never see an auditing failure; counted
            self.internal_errors += 1

    def begin(self, flush_interval_ns: int) -> None:
        """Reserve seq 0 for the ``recorder_started`` event; call once, before the first ``put``."""
        with self._lock:
            assert self._seq == 0 and self._started is None, "EventBuffer.begin: events were numbered already"
            self._started = (
                STARTED_CODE,
                0,
                monotonic_ns(),
                None,
                None,
                None,
                _payload("recorder_started", flush_interval_ns=flush_interval_ns),
            )
            self._seq = 1

    def end(self) -> None:
        """Close the instance: the next ``drain`` ends with a ``recorder_closed`` event, numbered last."""
        with self._lock:
            self._ending = True

    def mark(self, marker: threading.Event) -> None:
        """Queue a flush marker behind every event put so far; ``drain`` hands it back to be set."""
        with self._lock:
            self._buf.append(marker)  # bypasses the capacity check on purpose

    def drain(self, gap_rows: list[GapRow]) -> tuple[list, list[threading.Event]]:
        """Take everything buffered, plus one gap event per entry of ``gap_rows`` and one for drops so far.

        Returns (event tuples, flush markers) and empties ``gap_rows``. Runs under the lock so every
        sequence number below a gap event's is either in the returned tuples or already lost: batches
        stay in sequence order.
        """
        with self._lock:
            items, self._buf = self._buf, deque()
            if self.dropped_events:
                gap_rows.append(
                    (
                        "buffer_full",
                        self.dropped_events,
                        self.dropped_pages,
                        f"recorder buffer full (capacity {self.capacity_events} events)",
                    )
                )
                self.dropped_events = self.dropped_pages = 0
            for reason, events, pages, detail in gap_rows:
                seq = self._seq
                self._seq = seq + 1
                payload = gap_payload(reason, events, pages, detail)
                items.append((GAP_CODE, seq, monotonic_ns(), None, None, None, payload))
            gap_rows.clear()
            if self._ending:
                seq = self._seq
                self._seq = seq + 1
                items.append(
                    (
                        CLOSED_CODE,
                        seq,
                        monotonic_ns(),
                        None,
                        None,
                        None,
                        _payload("recorder_closed", dropped_events=self.total_dropped),
                    )
                )
                self._ending = False
        markers = [x for x in items if type(x) is threading.Event]
        out = [x for x in items if type(x) is not threading.Event] if markers else list(items)
        # Only the writer thread drains, so handing out the started event needs no lock.
        if out and self._started is not None:
            out.insert(0, self._started)
            self._started = None
        return out, markers
