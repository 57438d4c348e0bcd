"""The in-process recorder the serving code calls on its hot path.

A call copies the page array and hands one tuple to the recorder's
:class:`~kvtrail.audit.buffer.EventBuffer`, which numbers it and reads the monotonic clock: O(1)
Python work plus the copy, no I/O, never an exception into the caller. One background
:class:`~kvtrail.audit.writer.Writer` thread drains the buffer into columnar batches and commits
them. When the buffer is full the event is dropped *and counted*; the count reaches the store as a
``recorder_gap`` event and :meth:`Recorder.stats`, so a gap is always visible. Dropped events still
consume their sequence number, so the store can prove how many are missing.

An instance's events are framed: ``recorder_started`` (seq 0, with the flush interval: the most time
an event waits in memory before it is committed) and, on :meth:`Recorder.close`, ``recorder_closed``
(the last seq). An instance that ends without ``recorder_closed`` (the process was killed) may have
lost up to about one flush interval of its newest events; ``kvtrail audit verify`` reports it.

Each method's payload tuple holds its kind's fields in the order of
:data:`kvtrail.audit.events.PAYLOAD_LAYOUT`, which the writer reads them back with.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from kvtrail.audit.buffer import EventBuffer, gap_payload
from kvtrail.audit.contract import AuditRecorder, PageIds, Sink
from kvtrail.audit.events import KIND_CODES, Producer, RequestRef
from kvtrail.audit.writer import Writer

_C = KIND_CODES
_GAP = KIND_CODES["recorder_gap"]
# The kinds the allocator and attention paths record per call, as module constants: the hot path
# then pays one global lookup instead of a global plus a dict lookup.
_ALLOCATED = KIND_CODES["pages_allocated"]
_FREED = KIND_CODES["pages_freed"]
_WRITTEN = KIND_CODES["kv_written"]
_READ = KIND_CODES["kv_read"]
_NDARRAY = np.ndarray


def _copy_pages(pages):
    """Snapshot a page list so the caller may reuse its buffer: ndarray copy, or a tuple of a list.

    The page-list calls below snapshot 1-D ndarrays and lists themselves (see there) and come here
    for everything else.
    """
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
    # How often the writer drains the buffer: the most time an event waits in memory before it is
    # committed, so what a killed process can lose (recorded in recorder_started as flush_interval_ns).
    flush_interval_s: float = 0.02
    max_batch_events: int = 200_000  # largest batch the writer commits at once

    def __post_init__(self):
        if self.capacity_events < 1:
            raise ValueError("recorder config 'capacity_events': must be >= 1")
        if not self.flush_interval_s > 0:
            raise ValueError("recorder config 'flush_interval_s': must be > 0")
        if self.max_batch_events < 1:
            raise ValueError("recorder config 'max_batch_events': must be >= 1")

    @property
    def flush_interval_ns(self) -> int:
        return max(1, round(self.flush_interval_s * 1e9))


class Recorder:
    """Records audit events of one producer into a sink: an AuditStore path, a service URL, or an object with
    ``append``.

    Every public recording method is safe to call from any thread and never raises.
    """

    def __init__(
        self, sink: Sink | str | Path, producer: Producer, config: RecorderConfig = RecorderConfig(), *, signer=None
    ):
        self.producer = producer
        self.config = config
        self._buffer = EventBuffer(config.capacity_events)
        self._buffer.begin(config.flush_interval_ns)
        # Bound once: the hot path pays one attribute lookup, as for a method of this class.
        self._put = self._buffer.put
        if isinstance(sink, str) and sink.startswith(("http://", "https://")):
            from kvtrail.audit.httpsink import HttpSink  # httpx only where a service is the sink

            sink = HttpSink.from_url(sink)  # the producer token comes from KVTRAIL_TOKEN
        elif isinstance(sink, (str, Path)):
            from kvtrail.audit.store import AuditStore  # DuckDB only where the recorder owns the store

            sink = AuditStore(sink, signer=signer)
        self._writer = Writer(
            self._buffer,
            sink,
            producer,
            flush_interval_s=config.flush_interval_s,
            max_batch_events=config.max_batch_events,
        )
        self._writer.start()

    @property
    def total_dropped(self) -> int:
        """Events dropped because the buffer was full, since the recorder started."""
        return self._buffer.total_dropped

    # ---- hot path ------------------------------------------------------------------------------

    def node_config(
        self,
        *,
        pool_tokens: int,
        pool_pages: int,
        page_size: int,
        context_tokens: int,
        max_running_requests: int | None = None,
        checksum_enabled: bool | None = None,
        canary_enabled: bool | None = None,
        deferred_release: bool | None = None,
        page_tags: bool | None = None,
        config_source: str | None = None,
        release_timeout_ns: int | None = None,
        transfer_batch_max_pages: int | None = None,
    ) -> None:
        self._put(
            _C["node_config"],
            None,
            None,
            None,
            (
                pool_tokens,
                pool_pages,
                page_size,
                context_tokens,
                max_running_requests,
                checksum_enabled,
                canary_enabled,
                deferred_release,
                page_tags,
                config_source,
                release_timeout_ns,
                transfer_batch_max_pages,
            ),
        )

    def request_received(self, req: RequestRef, prompt_tokens: int, max_new_tokens: int | None = None) -> None:
        self._put(_C["request_received"], req, None, None, (prompt_tokens, max_new_tokens))

    # The four calls below carry the page lists of every allocation, free, write and read. A 1-D ndarray
    # is snapshot as its bytes, with its dtype in the (for these kinds unused) dst_pages slot of the
    # buffered tuple: ``tobytes`` costs about a third of ``copy``, and the writer joins the bytes of a
    # batch at once. A list becomes a tuple inline; anything else goes through _copy_pages.
    def pages_allocated(
        self, req: RequestRef, pages: PageIds, purpose: str, block_hashes: PageIds | None = None
    ) -> None:
        extra = (purpose, None if block_hashes is None else _copy_pages(block_hashes))
        if type(pages) is _NDARRAY and pages.ndim == 1:
            self._put(_ALLOCATED, req, pages.tobytes(), pages.dtype, extra)
        else:
            self._put(_ALLOCATED, req, tuple(pages) if type(pages) is list else _copy_pages(pages), None, extra)

    def pages_freed(self, req: RequestRef | None, pages: PageIds, reason: str) -> None:
        if type(pages) is _NDARRAY and pages.ndim == 1:
            self._put(_FREED, req, pages.tobytes(), pages.dtype, (reason,))
        else:
            self._put(_FREED, req, tuple(pages) if type(pages) is list else _copy_pages(pages), None, (reason,))

    def kv_written(
        self,
        req: RequestRef,
        pages: PageIds,
        token_start: int,
        token_end: int,
        source: str,
        page_digests: PageIds | None = None,
        digest_algo: str | None = None,
        block_hashes: PageIds | None = None,
    ) -> None:
        extra = (
            token_start,
            token_end,
            source,
            None if page_digests is None else _copy_pages(page_digests),
            digest_algo,
            None if block_hashes is None else _copy_pages(block_hashes),
        )
        if type(pages) is _NDARRAY and pages.ndim == 1:
            self._put(_WRITTEN, req, pages.tobytes(), pages.dtype, extra)
        else:
            self._put(_WRITTEN, req, tuple(pages) if type(pages) is list else _copy_pages(pages), None, extra)

    def kv_read(
        self, req: RequestRef, pages: PageIds, page_digests: PageIds | None = None, digest_algo: str | None = None
    ) -> None:
        extra = (None if page_digests is None else _copy_pages(page_digests), digest_algo)
        if type(pages) is _NDARRAY and pages.ndim == 1:
            self._put(_READ, req, pages.tobytes(), pages.dtype, extra)
        else:
            self._put(_READ, req, tuple(pages) if type(pages) is list else _copy_pages(pages), None, extra)

    def transfer_reserved(self, req: RequestRef, pages: PageIds, num_tokens: int) -> None:
        self._put(_C["transfer_reserved"], req, _copy_pages(pages), None, (num_tokens,))

    def transfer_sent(
        self,
        req: RequestRef,
        pages: PageIds,
        dst_pages: PageIds,
        num_tokens: int,
        is_last_chunk: bool,
        digest: int | None = None,
        digest_algo: str | None = None,
        digest_tokens: int | None = None,
    ) -> None:
        self._put(
            _C["transfer_sent"],
            req,
            _copy_pages(pages),
            _copy_pages(dst_pages),
            (num_tokens, is_last_chunk, digest, digest_algo, digest_tokens),
        )

    def transfer_received(
        self,
        req: RequestRef,
        pages: PageIds,
        num_tokens: int,
        status: str,
        digest: int | None = None,
        digest_algo: str | None = None,
        digest_tokens: int | None = None,
    ) -> None:
        self._put(
            _C["transfer_received"],
            req,
            _copy_pages(pages),
            None,
            (num_tokens, status, digest, digest_algo, digest_tokens),
        )

    def request_aborted(
        self, req: RequestRef, stage: str, reason: str, http_status: int, prompt_tokens: int | None = None
    ) -> None:
        self._put(_C["request_aborted"], req, None, None, (stage, reason, http_status, prompt_tokens))

    def response_sent(
        self,
        req: RequestRef,
        http_status: int,
        prompt_tokens: int,
        completion_tokens: int,
        latency_ns: int,
        ttft_ns: int | None = None,
        finish_reason: str | None = None,
        spec_verify_steps: int | None = None,
        spec_accepted_drafts: int | None = None,
        spec_proposed_drafts: int | None = None,
    ) -> None:
        self._put(
            _C["response_sent"],
            req,
            None,
            None,
            (
                http_status,
                prompt_tokens,
                completion_tokens,
                latency_ns,
                ttft_ns,
                finish_reason,
                spec_verify_steps,
                spec_accepted_drafts,
                spec_proposed_drafts,
            ),
        )

    def kv_canary_violation(
        self,
        pages: PageIds,
        canary_slot: int,
        canary_tag: str,
        canary_reason: str,
        canary_position: int | None = None,
    ) -> None:
        """The engine's KV canary failed on token slot ``canary_slot`` of the pool; ``pages``: the page holding it."""
        self._put(
            _C["kv_canary_violation"],
            None,
            _copy_pages(pages),
            None,
            (canary_slot, canary_tag, canary_reason, canary_position),
        )

    def events_lost(self, reason: str, events: int, pages: int, detail: str) -> None:
        """Record a ``recorder_gap`` for events lost before they reached this recorder (see the contract)."""
        self._put(_GAP, None, None, None, gap_payload(reason, events, pages, detail))

    # ---- control -------------------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Block until every event recorded before this call is committed, counted as lost, or held.

        Held are the ``recorder_started`` and latest ``node_config`` of a batch the sink lost: they go
        first in the next batch the writer sends (``held_events`` in :meth:`stats`).

        Returns False if ``timeout`` (seconds) passed first or the writer has stopped.
        """
        done = threading.Event()
        self._buffer.mark(done)
        self._writer.wake()
        return self._writer.is_alive() and done.wait(timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Record ``recorder_closed``, flush, stop the writer thread and close the sink."""
        if self._writer.is_alive():
            self._buffer.end()
            self.flush(timeout)
            self._writer.stop(timeout)

    def stats(self) -> dict[str, int]:
        """Counters for metrics and reports (what was recorded, lost, committed)."""
        w, b = self._writer, self._buffer
        return {
            "recorded_events": b.next_seq,
            "buffered_events": len(b),
            "held_events": len(w.held),
            "dropped_events_total": b.total_dropped,
            "invalid_events_total": w.invalid_total,
            "writer_errors_total": w.error_total,
            "internal_errors_total": b.internal_errors,
            "committed_events_total": w.committed_events,
            "committed_page_events_total": w.committed_page_events,
            "committed_batches_total": w.committed_batches,
            "writer_cpu_ns_total": w.cpu_ns,
        }

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class NullRecorder:
    """The Recorder's API recording nothing: auditing switched off (the baseline of overhead benchmarks)."""

    def node_config(
        self,
        *,
        pool_tokens: int,
        pool_pages: int,
        page_size: int,
        context_tokens: int,
        max_running_requests: int | None = None,
        checksum_enabled: bool | None = None,
        canary_enabled: bool | None = None,
        deferred_release: bool | None = None,
        page_tags: bool | None = None,
        config_source: str | None = None,
        release_timeout_ns: int | None = None,
        transfer_batch_max_pages: int | None = None,
    ) -> None:
        return None

    def request_received(self, req: RequestRef, prompt_tokens: int, max_new_tokens: int | None = None) -> None:
        return None

    def pages_allocated(
        self, req: RequestRef, pages: PageIds, purpose: str, block_hashes: PageIds | None = None
    ) -> None:
        return None

    def pages_freed(self, req: RequestRef | None, pages: PageIds, reason: str) -> None:
        return None

    def kv_written(
        self,
        req: RequestRef,
        pages: PageIds,
        token_start: int,
        token_end: int,
        source: str,
        page_digests: PageIds | None = None,
        digest_algo: str | None = None,
        block_hashes: PageIds | None = None,
    ) -> None:
        return None

    def kv_read(
        self, req: RequestRef, pages: PageIds, page_digests: PageIds | None = None, digest_algo: str | None = None
    ) -> None:
        return None

    def transfer_reserved(self, req: RequestRef, pages: PageIds, num_tokens: int) -> None:
        return None

    def transfer_sent(
        self,
        req: RequestRef,
        pages: PageIds,
        dst_pages: PageIds,
        num_tokens: int,
        is_last_chunk: bool,
        digest: int | None = None,
        digest_algo: str | None = None,
        digest_tokens: int | None = None,
    ) -> None:
        return None

    def transfer_received(
        self,
        req: RequestRef,
        pages: PageIds,
        num_tokens: int,
        status: str,
        digest: int | None = None,
        digest_algo: str | None = None,
        digest_tokens: int | None = None,
    ) -> None:
        return None

    def request_aborted(
        self, req: RequestRef, stage: str, reason: str, http_status: int, prompt_tokens: int | None = None
    ) -> None:
        return None

    def response_sent(
        self,
        req: RequestRef,
        http_status: int,
        prompt_tokens: int,
        completion_tokens: int,
        latency_ns: int,
        ttft_ns: int | None = None,
        finish_reason: str | None = None,
        spec_verify_steps: int | None = None,
        spec_accepted_drafts: int | None = None,
        spec_proposed_drafts: int | None = None,
    ) -> None:
        return None

    def kv_canary_violation(
        self,
        pages: PageIds,
        canary_slot: int,
        canary_tag: str,
        canary_reason: str,
        canary_position: int | None = None,
    ) -> None:
        return None

    def events_lost(self, reason: str, events: int, pages: int, detail: str) -> None:
        return None

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self, timeout: float | None = 30.0) -> None:
        return None

    def stats(self) -> dict[str, int]:
        return {}


def make_recorder(
    enabled: bool, sink: Callable[[], Sink], producer: Producer, config: RecorderConfig | None = None
) -> AuditRecorder:
    """A :class:`Recorder` committing into ``sink()`` when ``enabled``, else a :class:`NullRecorder`.

    ``sink`` is a factory so that a switched-off process never opens a store or a relay connection.
    """
    if not enabled:
        return NullRecorder()
    return Recorder(sink(), producer, config if config is not None else RecorderConfig())
