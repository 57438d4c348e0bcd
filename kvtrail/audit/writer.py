"""The recorder's background writer: the one thread that owns the sink (the DuckDB store).

It drains the recorder's :class:`~kvtrail.audit.buffer.EventBuffer` every ``flush_interval_s`` (or at
once on ``flush``), turns the tuples into one columnar batch and commits it. Payload tuples are read
back with :data:`kvtrail.audit.events.PAYLOAD_LAYOUT_BY_CODE`, the table the recorder built them by.
An event the store rejects is taken out of its batch and counted (the rest of the batch still
lands); the count becomes a ``recorder_gap`` event. A refusal lists every event that breaks the rule
it names, and all of them are taken out at once: a batch costs one more try per rule broken, not one
per bad event. A sink that fails (disk full, I/O error) is retried, then the batch is counted as
lost: the serving path is never blocked by the store.

Two events of a lost batch are held instead and go first in the next batch: the instance's
``recorder_started`` and its latest ``node_config``. The store checks every later page id against
the pool size that configuration reports, so without it everything the node sends after an outage
at its start would be refused as invalid until the node reported its configuration again; and
without ``recorder_started`` the instance would no longer frame its events. They keep their
sequence numbers and clocks (what the node reported, when it reported it); a held ``node_config``
that a newer one follows in a lost batch is lost with that batch. Held events count as lost only
if the writer stops with the sink still failing. (A batch sent event by event, after the sink refused
it without naming the event, holds nothing: the events after a lost one may land before it could.)
"""

from __future__ import annotations

import logging
import threading
import time
from itertools import repeat
from operator import is_, is_not, itemgetter
from typing import Sequence

import numpy as np
import pyarrow as pa

from kvtrail.audit.arrowutil import INT32_MAX, list_array, pack_lists
from kvtrail.audit.batch import BATCH_SCHEMA, NULLABLE_BATCH_SCHEMA, first_bad_index
from kvtrail.audit.buffer import GAP_CODE, GAP_EVENTS_AT, GAP_PAGES_AT, STARTED_CODE, EventBuffer, GapRow
from kvtrail.audit.contract import Sink
from kvtrail.audit.events import (
    KIND_CODES,
    KIND_NAMES,
    NO_REQUEST,
    PAYLOAD_LAYOUT_BY_CODE,
    PRODUCER_FIELDS,
    SCHEMA_VERSION,
    Producer,
    RequestRef,
)
from kvtrail.errors import ValidationError

log = logging.getLogger("kvtrail.audit")
_TYPES = {f.name: f.type for f in BATCH_SCHEMA}
_RETRY_DELAYS_S = (0.05, 0.25, 1.0)
# Up to this many events a column shared by several kinds is scattered into a Python list and
# converted once: cheaper than converting each kind's part and reordering them with a take, which
# wins on large batches. A serving process's writer commits a few hundred events per flush.
_SCATTER_MAX_EVENTS = 2048
# The kinds a lost batch does not take with it (the module's docstring says why).
_HELD_CODES = (STARTED_CODE, KIND_CODES["node_config"])


def _list_column(values: Sequence, type_: pa.DataType, field: str) -> pa.Array:
    """Build a list column from per-event tuples/arrays (None for absent) in a few C-level passes."""
    wide = np.uint64 if pa.types.is_uint64(type_.value_type) else np.int64
    flat, offsets, absent = pack_lists(values, wide)
    return _checked_list(flat, offsets, type_, absent, field)


def _checked_list(flat: np.ndarray, offsets: np.ndarray, type_: pa.DataType, absent, field: str) -> pa.Array:
    """The list column of ``flat`` values at ``offsets``; an int32 column's values checked for range."""
    if pa.types.is_int32(type_.value_type) and flat.size and flat.dtype != np.int32:
        bad = (flat > INT32_MAX) | (flat < -INT32_MAX)
        if bad.any():
            row = int(np.searchsorted(offsets, np.flatnonzero(bad)[0], side="right") - 1)
            raise ValidationError(field, f"page id {int(flat[bad][0])} out of range", event=row)
    return list_array(flat, offsets, type_.value_type, absent, field=field)


def page_snapshots(pages: Sequence, dsts: Sequence) -> tuple[pa.Array, Sequence]:
    """The ``pages`` column of buffered events, and their ``dst_pages`` values.

    ``pages`` may hold the recorder's ndarray snapshots: a 1-D array's bytes, its dtype in the dst
    slot. The snapshots of one dtype are read back at once from their joined bytes and written into
    the column's values beside the other rows' lists, with no Python per event. A snapshot of a dtype
    that is not an integer type is refused (``ValidationError`` naming the event).
    """
    n = len(pages)
    snap = np.fromiter(map(is_, map(type, pages), repeat(bytes)), dtype=bool, count=n)
    if not snap.any():
        return _list_column(pages, _TYPES["pages"], "pages"), dsts
    at = np.flatnonzero(snap).tolist()
    kinds = [dsts[i] for i in at]
    groups: dict = {}
    if len(set(kinds)) == 1:  # the common case: one dtype, no Python per event
        groups[kinds[0]] = at
    else:
        for i, dt in zip(at, kinds):
            groups.setdefault(dt, []).append(i)
    lengths = np.zeros(n, np.int64)
    parts = []  # (rows, their lists' values back to back, in row order)
    for dt, mine in groups.items():
        if not (isinstance(dt, np.dtype) and dt.kind in "iu"):
            raise ValidationError("pages", f"page ids of dtype {dt} are not integers", event=mine[0])
        blobs = [pages[i] for i in mine]
        lengths[mine] = np.fromiter(map(len, blobs), dtype=np.int64, count=len(blobs)) // dt.itemsize
        parts.append((np.array(mine, np.int64), np.frombuffer(b"".join(blobs), dt)))
    others = np.flatnonzero(~snap)
    absent = np.zeros(n, bool)
    if len(others):
        flat, offs, gone = pack_lists([pages[i] for i in others.tolist()], np.int64)
        lengths[others] = np.diff(offs)
        if gone is not None:
            absent[others[gone]] = True
        parts.append((others, flat))
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    parts = [p for p in parts if len(p[1])]
    if len(parts) == 1:  # the other rows have empty lists: this part's values are the column's
        values = parts[0][1] if parts[0][1].dtype == np.int32 else parts[0][1].astype(np.int64)
    else:
        values = np.empty(int(offsets[-1]), np.int64)
        for where, flat in parts:  # each part's lists go to their rows' offsets
            lens = lengths[where]
            starts = np.cumsum(lens) - lens
            values[np.repeat(offsets[where] - starts, lens) + np.arange(len(flat))] = flat
    column = _checked_list(values, offsets, _TYPES["pages"], absent if absent.any() else None, "pages")
    snapped = snap.tolist()
    return column, [None if s else d for d, s in zip(dsts, snapped)]


def _convert(values, f: pa.Field, rows: np.ndarray | None) -> pa.Array:
    """One payload column (or the part of it one kind supplies) to Arrow; errors name the batch row."""
    try:
        if pa.types.is_list(f.type):
            return _list_column(list(values), f.type, f.name)
        try:
            return pa.array(values, f.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as exc:
            raise ValidationError(
                f.name, f"wrong type or out of range for {f.type}: {exc}", event=first_bad_index(list(values), f.type)
            ) from None
    except ValidationError as exc:
        if rows is None or exc.event is None:
            raise
        raise exc.moved(rows) from None


def _payload_columns(codes: tuple, payloads: tuple, layouts: tuple, n: int, done: set) -> dict[str, pa.Array]:
    """Scatter per-kind payload tuples into full-length columns, kind by kind, without a per-event loop."""
    code_arr = np.fromiter(codes, dtype=np.int16, count=n)
    kinds = np.unique(code_arr)
    parts: dict[str, list] = {}
    for k in kinds.tolist():
        rows = None if len(kinds) == 1 else np.flatnonzero(code_arr == k)
        if rows is None:
            group = payloads
        elif len(rows) == 1:
            group = (payloads[int(rows[0])],)
        else:
            group = itemgetter(*rows.tolist())(payloads)
        assert len(group[0]) == len(layouts[k]), f"kind {KIND_NAMES[k]}: payload tuple does not match its layout"
        for name, values in zip(layouts[k], zip(*group)):
            if any(map(is_not, values, repeat(None))):  # in C; (tuple.count would compare arrays with ==)
                parts.setdefault(name, []).append((rows, values))
    out = {}
    for f in BATCH_SCHEMA:
        if f.name in done:
            continue
        pieces = parts.get(f.name)
        if not pieces:
            out[f.name] = pa.nulls(n, f.type)
        elif pieces[0][0] is None:  # one kind in the batch: already in row order
            out[f.name] = _convert(pieces[0][1], f, None)
        elif n <= _SCATTER_MAX_EVENTS:
            column: list = [None] * n
            for rows, values in pieces:
                for row, value in zip(rows.tolist(), values):
                    column[row] = value
            out[f.name] = _convert(column, f, None)
        else:
            # Row i of the column takes element inverse[i] of the kinds' pieces laid end to end; rows of
            # kinds without the field point at one null appended last (a take, no sort of the rows).
            arrays = [_convert(values, f, rows) for rows, values in pieces]
            total = sum(len(rows) for rows, _ in pieces)
            inverse = np.full(n, total, dtype=np.int64)
            at = 0
            for rows, _ in pieces:
                inverse[rows] = np.arange(at, at + len(rows))
                at += len(rows)
            arrays.append(pa.nulls(1, f.type))
            out[f.name] = pa.concat_arrays(arrays).take(pa.array(inverse))
    return out


def wall_offset_ns() -> int:
    """Current wall-clock minus monotonic clock, both in ns (read back to back)."""
    return time.time_ns() - time.monotonic_ns()


def build_batch(producer: Producer, items: list, wall_offset: int | None = None) -> pa.Table:
    """Turn buffered tuples ``(code, seq, mono_ns, req, pages, dst, payload)`` into a batch table.

    ``wall_ns`` is ``mono_ns + wall_offset`` (offset read now unless given).
    """
    n = len(items)
    codes, seqs, monos, reqs, pages, dsts, payloads = zip(*items)
    mono = np.fromiter(monos, dtype=np.int64, count=n)
    offset = wall_offset_ns() if wall_offset is None else wall_offset
    cols: dict[str, pa.Array] = {
        "schema_version": pa.repeat(pa.scalar(SCHEMA_VERSION, pa.int32()), n),
        "seq": pa.array(seqs, pa.uint64()),
        "wall_ns": pa.array(mono + offset),
        "mono_ns": pa.array(mono),
        "kind": pa.DictionaryArray.from_arrays(pa.array(codes, pa.int8()), pa.array(KIND_NAMES)).cast(pa.string()),
    }
    for f in PRODUCER_FIELDS:
        cols[f.name] = pa.repeat(pa.scalar(getattr(producer, f.name), pa.string()), n)
    req_columns = zip(*[NO_REQUEST if r is None else r for r in reqs])
    for name, values in zip(RequestRef._fields, req_columns):
        cols[name] = pa.array(values, _TYPES[name])
    cols["pages"], dst_lists = page_snapshots(pages, dsts)
    cols["dst_pages"] = _list_column(dst_lists, _TYPES["dst_pages"], "dst_pages")
    cols.update(_payload_columns(codes, payloads, PAYLOAD_LAYOUT_BY_CODE, n, set(cols)))
    return pa.Table.from_arrays([cols[f.name] for f in BATCH_SCHEMA], schema=NULLABLE_BATCH_SCHEMA)


class Writer(threading.Thread):
    """Drains one producer's event buffer into one sink. Started by the recorder; stopped by ``Recorder.close``."""

    def __init__(
        self, buffer: EventBuffer, sink: Sink, producer: Producer, *, flush_interval_s: float, max_batch_events: int
    ):
        super().__init__(name=f"kvtrail-writer-{producer.node}", daemon=True)
        self._buffer = buffer
        self._sink = sink
        self._producer = producer
        self._interval_s = flush_interval_s
        self._max_batch_events = max_batch_events
        self._wake = threading.Event()
        self._stopping = False
        self._pending_gaps: list[GapRow] = []
        self.held: list[tuple] = []  # framing events of lost batches, in sequence order, for the next batch
        self._offset = wall_offset_ns()
        self.invalid_total = 0
        self.error_total = 0
        self.committed_events = 0
        self.committed_page_events = 0
        self.committed_batches = 0
        # CPU this thread spent in its cycles (building, encoding and sending batches): the recorder's
        # cost outside the hot path, read by the serving benchmark beside the processes' CPU.
        self.cpu_ns = 0

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float | None) -> None:
        self._stopping = True
        self._wake.set()
        self.join(timeout)

    def run(self) -> None:
        interval = self._interval_s
        try:
            while not self._stopping:
                # Wake on ticks of the system-wide monotonic clock, so writers in different processes
                # drain together and a relay can commit their batches in one transaction.
                self._wake.wait(interval - time.monotonic() % interval)
                self._wake.clear()
                self._safe_cycle()
            self._safe_cycle()
            if self.held:  # the sink still failed on the last try: nothing will send them now
                self.error_total += len(self.held)
                log.error("kvtrail recorder: %d held events lost at stop, store failed", len(self.held))
                self.held = []
        finally:
            close = getattr(self._sink, "close", None)
            if close is not None:
                close()

    def _safe_cycle(self) -> None:
        started_ns = time.thread_time_ns()
        try:
            self._cycle()
        except Exception:  # noqa: BLE001 - the writer thread must outlive any bug; the loss is logged and counted
            self.error_total += 1
            log.exception("kvtrail recorder: writer cycle failed")
        finally:
            self.cpu_ns += time.thread_time_ns() - started_ns

    def _cycle(self) -> None:
        self._offset = wall_offset_ns()
        markers: list[threading.Event] = []
        # Losses found while committing become gap events in one more drain; if the store is failing
        # they stay pending for the next cycle rather than looping here.
        for _ in range(2):
            items, new_markers = self._buffer.drain(self._pending_gaps)
            markers += new_markers
            if self.held and not items:  # nothing else to send: the held events go on their own
                self._commit([])
            step = self._max_batch_events
            for i in range(0, len(items), step):
                self._commit(items[i : i + step])
            if not self._pending_gaps:
                break
        for m in markers:
            m.set()

    def _commit(self, items: list) -> None:
        invalid: list[str] = []
        if self.held:  # they are older than anything drained since: they go first
            items = self.held + items
            self.held = []
        while items:
            try:
                result = self._append(items)
            except ValidationError as exc:
                if len(items) == 1:
                    invalid.append(str(exc))
                    break
                # Every event the refusal lists breaks its rule on its own: all go at once (one more try
                # per rule broken, not one per bad event).
                gone = [i for i in exc.events if 0 <= i < len(items)]
                if not gone:  # cannot tell which event: isolate them one at a time
                    self._one_by_one(items, invalid)
                    break
                invalid.extend([str(exc)] * len(gone))
                drop = set(gone)
                items = [it for i, it in enumerate(items) if i not in drop]
                continue
            except Exception as exc:  # noqa: BLE001 - sink failure: retried, then counted as lost
                if not self._retry(items, exc):
                    self._lose(items, exc)
                break
            self._count(result)
            break
        if invalid:
            self.invalid_total += len(invalid)
            detail = "; ".join(dict.fromkeys(invalid[:5]))[:1000]
            self._pending_gaps.append(("invalid", len(invalid), 0, detail))
            log.warning("kvtrail recorder: %d invalid events not stored; first: %s", len(invalid), invalid[0])

    def _append(self, items: list):
        try:
            table = build_batch(self._producer, items, self._offset)
        except ValidationError:
            raise
        except Exception as exc:  # noqa: BLE001 - garbage from the caller is invalid input, not a store failure
            raise ValidationError("(event)", f"cannot encode: {type(exc).__name__}: {exc}") from None
        return self._sink.append(table)

    def _lose(self, items: list, exc: Exception) -> None:
        """The store failed ``items`` after its retries: the framing and configuration are held, the rest
        counted lost (a gap event reports them in a later batch)."""
        items = self._hold(items)
        if items:
            lost, lost_pages, own = _lost_counts(items)
            self.error_total += own
            self._pending_gaps.append(("writer_error", lost, lost_pages, f"{type(exc).__name__}: {exc}"))
            log.error("kvtrail recorder: %d events lost, store failed: %s", own, exc)
        else:
            log.warning("kvtrail recorder: store failed (%s); %d events held", exc, len(self.held))

    def _hold(self, items: list) -> list:
        """Keep the lost batch's ``recorder_started`` and latest ``node_config`` for the next batch; the
        rest of ``items`` is returned (the lost events)."""
        last: dict[int, int] = {}
        for i, it in enumerate(items):
            if it[0] in _HELD_CODES:
                last[it[0]] = i
        if not last:
            return items
        keep = sorted(last.values())
        self.held = [items[i] for i in keep]
        kept = set(keep)
        return [it for i, it in enumerate(items) if i not in kept]

    def _count(self, result) -> None:
        self.committed_events += result.num_events
        self.committed_page_events += result.num_page_events
        self.committed_batches += len(result.batches)

    def _one_by_one(self, items: list, invalid: list[str]) -> None:
        """A refusal that did not say which events broke its rule: each event on its own. Should the store
        fail meanwhile (after its retries), the events not yet sent go the way of a failed batch: the
        framing and configuration held, the rest counted lost."""
        for k, item in enumerate(items):
            try:
                self._count(self._append([item]))
            except ValidationError as exc:
                invalid.append(str(exc))
            except Exception as exc:  # noqa: BLE001 - a store failure, as in _commit
                if not self._retry([item], exc):
                    self._lose(items[k:], exc)
                    return

    def _retry(self, items: list, first_exc: Exception) -> bool:
        log.warning("kvtrail recorder: store append failed (%s); retrying", first_exc)
        for delay in _RETRY_DELAYS_S:
            time.sleep(delay)
            try:
                self._count(self._append(items))
                return True
            except Exception:  # noqa: BLE001 - keep retrying; the final failure is counted by the caller
                continue
        return False


def _lost_counts(items: list) -> tuple[int, int, int]:
    """(sequence numbers, pages, events of the caller's own) a failed batch loses. A lost gap event carries
    the losses it was reporting and its own sequence number on to the next gap event (so the store's missing
    numbers stay explained), but was no event of the caller's: ``writer_errors_total`` counts those once."""
    events = pages = own = 0
    for it in items:
        if it[0] == GAP_CODE:
            events += it[6][GAP_EVENTS_AT] + 1
            pages += it[6][GAP_PAGES_AT] or 0
        else:
            events += 1
            own += 1
            if type(it[4]) is bytes:  # an ndarray snapshot, its dtype in the dst slot
                pages += len(it[4]) // it[5].itemsize
            elif isinstance(it[4], (tuple, np.ndarray)) and np.ndim(it[4]) == 1:
                pages += len(it[4])
    return events, pages, own
