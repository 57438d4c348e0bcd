"""The in-process recorder the serving code calls on its hot path.

A call takes a sequence number and both clocks, copies the page array and appends a tuple to a
bounded buffer: O(1) Python work plus the copy, no I/O, never an exception into the caller. One
background :class:`~kvtrail.audit.writer.Writer` thread drains the buffer into columnar batches and
commits them. When the buffer is full the event is dropped *and counted*; the count reaches the
store as a ``recorder_gap`` event and :meth:`Recorder.stats`, so a gap is always visible. Dropped
events still consume their sequence number, so the store can prove how many are missing.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from time import monotonic_ns

import numpy as np

from kvtrail.audit.events import KIND_CODES, Producer, RequestRef

# Field order of the payload tuple each recorder method builds, by kind. The writer scatters
# payload values into columns with this table; tests round-trip every method through the store.
PAYLOAD_LAYOUT: dict[str, tuple[str, ...]] = {
    "node_config": ("pool_tokens", "pool_pages", "page_size", "context_tokens", "max_running_requests",
                    "checksum_enabled", "canary_enabled", "deferred_release", "page_tags", "config_source"),
    "request_received": ("prompt_tokens", "max_new_tokens"),
    "pages_allocated": ("purpose", "block_hashes"),
    "pages_freed": ("free_reason",),
    "kv_written": ("token_start", "token_end", "source", "page_digests", "digest_algo"),
    "kv_read": ("page_digests", "digest_algo"),
    "transfer_reserved": ("num_tokens",),
    "transfer_sent": ("num_tokens", "is_last_chunk", "digest", "digest_algo"),
    "transfer_received": ("num_tokens", "status", "digest", "digest_algo"),
    "request_aborted": ("stage", "abort_reason", "http_status", "prompt_tokens"),
    "response_sent": ("http_status", "prompt_tokens", "completion_tokens", "latency_ns", "ttft_ns", "finish_reason"),
    "recorder_gap": ("dropped_events", "dropped_pages", "gap_reason", "detail"),
}
LAYOUT_BY_CODE = tuple(PAYLOAD_LAYOUT[k] for k in KIND_CODES)
GAP_CODE = KIND_CODES["recorder_gap"]

_C = KIND_CODES
_NDARRAY = np.ndarray


def _copy_pages(pages):
    """Snapshot a page list so the caller may reuse its buffer: ndarray copy, or a tuple of a list."""
    t = type(pages)
    if t is _NDARRAY:
        return pages.copy()
    if t is list or t is tuple or t is range:
        return tuple(pages)
    return np.array(pages, copy=True)  # torch CPU tensors and other array-likes


@dataclass(frozen=True)
class RecorderConfig:
    """Tuning of one recorder. Defaults suit a serving process recording ~100k events/s."""

    capacity_events: int = 262_144  # bounded buffer; beyond it events are dropped and counted
    flush_interval_s: float = 0.02  # how often the writer drains the buffer
    max_batch_events: int = 200_000  # largest batch the writer commits at once

    def __post_init__(self):
        if self.capacity_events < 1:
            raise ValueError("recorder config 'capacity_events': must be >= 1")
        if not self.flush_interval_s > 0:
            raise ValueError("recorder config 'flush_interval_s': must be > 0")
        if self.max_batch_events < 1:
            raise ValueError("recorder config 'max_batch_events': must be >= 1")


class Recorder:
    """Records audit events of one producer into a sink (an AuditStore path, or an object with ``append``).

    Every public recording method is safe to call from any thread and never raises.
    """

    def __init__(self, sink, producer: Producer, config: RecorderConfig = RecorderConfig(), *, signer=None):
        from kvtrail.audit.writer import Writer  # keeps the hot-path module free of DuckDB imports

        self.producer = producer
        self.config = config
        self._lock = threading.Lock()
        self._buf: deque = deque()
        self._cap = config.capacity_events
        self._seq = 0
        self.dropped_events = 0  # buffer full, since the last gap event
        self.dropped_pages = 0
        self.internal_errors = 0  # exceptions caught on the hot path
        self.total_dropped = 0
        self.total_recorded = 0
        if isinstance(sink, (str, Path)):
            from kvtrail.audit.store import AuditStore

            sink = AuditStore(sink, signer=signer)
        self._writer = Writer(self, sink)
        self._writer.start()

    # ---- hot path ------------------------------------------------------------------------------

    def _put(self, code: int, req, pages, dst, payload: tuple) -> None:
        # Only the monotonic clock is read here; the writer derives wall_ns from it with a wall-clock
        # offset it re-reads at every drain, which saves a clock read per event.
        try:
            lock = self._lock
            lock.acquire()
            try:
                seq = self._seq
                self._seq = seq + 1
                buf = self._buf
                if len(buf) < self._cap:
                    buf.append((code, seq, monotonic_ns(), req, pages, dst, payload))
                else:
                    self.dropped_events += 1
                    self.total_dropped += 1
                    if pages is not None:
                        self.dropped_pages += len(pages)
            finally:
                lock.release()
        except Exception:  # noqa: BLE001 - the serving path must never see an auditing failure; counted
            self.internal_errors += 1

    def node_config(self, *, pool_tokens: int, pool_pages: int, page_size: int, context_tokens: int,
                    max_running_requests: int | None = None, checksum_enabled: bool | None = None,
                    canary_enabled: bool | None = None, deferred_release: bool | None = None,
                    page_tags: bool | None = None, config_source: str | None = None) -> None:
        self._put(_C["node_config"], None, None, None,
                  (pool_tokens, pool_pages, page_size, context_tokens, max_running_requests, checksum_enabled,
                   canary_enabled, deferred_release, page_tags, config_source))

    def request_received(self, req: RequestRef, prompt_tokens: int, max_new_tokens: int | None = None) -> None:
        self._put(_C["request_received"], req, None, None, (prompt_tokens, max_new_tokens))

    def pages_allocated(self, req: RequestRef, pages, purpose: str, block_hashes=None) -> None:
        self._put(_C["pages_allocated"], req, _copy_pages(pages), None,
                  (purpose, None if block_hashes is None else _copy_pages(block_hashes)))

    def pages_freed(self, req: RequestRef | None, pages, reason: str) -> None:
        self._put(_C["pages_freed"], req, _copy_pages(pages), None, (reason,))

    def kv_written(self, req: RequestRef, pages, token_start: int, token_end: int, source: str,
                   page_digests=None, digest_algo: str | None = None) -> None:
        self._put(_C["kv_written"], req, _copy_pages(pages), None,
                  (token_start, token_end, source, None if page_digests is None else _copy_pages(page_digests),
                   digest_algo))

    def kv_read(self, req: RequestRef, pages, page_digests=None, digest_algo: str | None = None) -> None:
        self._put(_C["kv_read"], req, _copy_pages(pages), None,
                  (None if page_digests is None else _copy_pages(page_digests), digest_algo))

    def transfer_reserved(self, req: RequestRef, pages, num_tokens: int) -> None:
        self._put(_C["transfer_reserved"], req, _copy_pages(pages), None, (num_tokens,))

    def transfer_sent(self, req: RequestRef, pages, dst_pages, num_tokens: int, is_last_chunk: bool,
                      digest: int | None = None, digest_algo: str | None = None) -> None:
        self._put(_C["transfer_sent"], req, _copy_pages(pages), _copy_pages(dst_pages),
                  (num_tokens, is_last_chunk, digest, digest_algo))

    def transfer_received(self, req: RequestRef, pages, num_tokens: int, status: str,
                          digest: int | None = None, digest_algo: str | None = None) -> None:
        self._put(_C["transfer_received"], req, _copy_pages(pages), None, (num_tokens, status, digest, digest_algo))

    def request_aborted(self, req: RequestRef, stage: str, reason: str, http_status: int,
                        prompt_tokens: int | None = None) -> None:
        self._put(_C["request_aborted"], req, None, None, (stage, reason, http_status, prompt_tokens))

    def response_sent(self, req: RequestRef, http_status: int, prompt_tokens: int, completion_tokens: int,
                      latency_ns: int, ttft_ns: int | None = None, finish_reason: str | None = None) -> None:
        self._put(_C["response_sent"], req, None, None,
                  (http_status, prompt_tokens, completion_tokens, latency_ns, ttft_ns, finish_reason))

    # ---- control -------------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every event recorded before this call is committed (or counted as lost).

        Returns False if ``timeout`` (seconds) passed first or the writer has stopped.
        """
        done = threading.Event()
        with self._lock:
            self._buf.append(done)  # a marker; bypasses the capacity check on purpose
        self._writer.wake()
        return self._writer.is_alive() and done.wait(timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Flush, stop the writer thread and close the sink."""
        if self._writer.is_alive():
            self.flush(timeout)
            self._writer.stop(timeout)

    def stats(self) -> dict:
        """Counters for metrics and reports (what was recorded, lost, committed)."""
        w = self._writer
        return {
            "recorded_events": self._seq,
            "buffered_events": len(self._buf),
            "dropped_events_total": self.total_dropped,
            "invalid_events_total": w.invalid_total,
            "writer_errors_total": w.error_total,
            "internal_errors_total": self.internal_errors,
            "committed_events_total": w.committed_events,
            "committed_page_events_total": w.committed_page_events,
            "committed_batches_total": w.committed_batches,
        }

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- used by the writer --------------------------------------------------------------------

    def _drain(self, gap_rows: list) -> tuple[list, list]:
        """Take everything buffered; emit gap events for losses so far. Returns (items, markers).

        Runs under the recorder lock so every sequence number below a gap event's is either in
        ``items`` or already lost: batches stay in sequence order.
        """
        with self._lock:
            items, self._buf = self._buf, deque()
            if self.dropped_events:
                gap_rows.append(("buffer_full", self.dropped_events, self.dropped_pages,
                                 f"recorder buffer full (capacity {self._cap} events)"))
                self.dropped_events = self.dropped_pages = 0
            for reason, events, pages, detail in gap_rows:
                seq = self._seq
                self._seq = seq + 1
                items.append((_C["recorder_gap"], seq, monotonic_ns(), None, None, None,
                              (events, pages, reason, detail)))
            gap_rows.clear()
        markers = [x for x in items if type(x) is threading.Event]
        if markers:
            items = [x for x in items if type(x) is not threading.Event]
        return list(items), markers


class NullRecorder:
    """The Recorder's API recording nothing: auditing switched off (the baseline of overhead benchmarks)."""

    def _ignore(self, *args, **kwargs) -> None:
        return None

    node_config = request_received = pages_allocated = pages_freed = kv_written = kv_read = _ignore
    transfer_reserved = transfer_sent = transfer_received = request_aborted = response_sent = _ignore

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self, timeout: float | None = 30.0) -> None:
        return None

    def stats(self) -> dict:
        return {}
