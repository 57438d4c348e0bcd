"""HttpSink: a recorder's writer commits its batches to a kvtrail service over HTTP.

``Recorder(HttpSink("http://audit:8080", token), producer)`` sends each batch the writer builds as one
Arrow IPC ``POST /v1/events`` and returns once the service has committed it. Transport errors and 5xx
replies are retried a few times with backoff; a retry of a batch that was in fact committed (its
reply was lost) is acknowledged by the service as a duplicate, so nothing is stored twice. A 422
becomes :class:`~kvtrail.errors.ValidationError` (the writer takes out the events it lists and counts
them); 413 splits the batch in two. Any other failure is a :class:`~kvtrail.errors.StoreError`: the
writer retries, then counts the batch as lost and reports it as a ``recorder_gap`` event, which
reaches the store with the first batch the service accepts again. The serving path never waits for
any of this: only the writer thread does.

When the first part of a split batch is committed and a later part is refused or fails, the sink
remembers the committed part's sequence numbers and leaves those events out when the writer sends
the batch again (without its refused events, or as a retry): they are stored once, never counted as
lost, and the next commit's result reports them to the writer.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrail.audit.batch import wire_table, write_ipc
from kvtrail.audit.store import AppendResult
from kvtrail.errors import StoreError, ValidationError

ARROW_STREAM = "application/vnd.apache.arrow.stream"
INGEST_PATH = "/v1/events"
TOKEN_ENV = "KVTRAIL_TOKEN"
URL_PREFIXES = ("http://", "https://")


def is_url(sink: object) -> bool:
    """Whether a recorder's sink argument names a service (an http:// or https:// URL) rather than a store path."""
    return isinstance(sink, str) and sink.startswith(URL_PREFIXES)


@dataclass(frozen=True)
class HttpSinkConfig:
    """Timeouts and retries of one sink. The writer retries a failed batch again on top of these."""

    connect_timeout_s: float = 2.0
    timeout_s: float = 30.0  # a large batch waits for its commit
    retries: int = 2
    backoff_s: float = 0.1  # doubled after each retry

    def __post_init__(self) -> None:
        if not (self.connect_timeout_s > 0 and self.timeout_s > 0):
            raise ValueError("http sink config 'timeout_s': timeouts must be > 0")
        if self.retries < 0 or self.backoff_s < 0:
            raise ValueError("http sink config 'retries': retries and backoff must be >= 0")


def _detail(reply: httpx.Response) -> str:
    try:
        body = reply.json()
    except ValueError:
        return reply.text[:200]
    return str(body.get("detail", body))[:200] if isinstance(body, dict) else str(body)[:200]


def _positions(value: object, rows: int) -> tuple[int, ...] | None:
    """A refusal's ``events`` list, if it is what the service sends (positions in the batch, ascending);
    else None, and the refusal names its one ``event``."""
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        return None
    if any(not 0 <= a < b < rows for a, b in zip(value, value[1:])) or (value and not 0 <= value[0] < rows):
        return None
    return tuple(value)


def _sum(a: AppendResult, b: AppendResult) -> AppendResult:
    return AppendResult(a.num_events + b.num_events, a.num_page_events + b.num_page_events, 0, a.batches + b.batches)


@dataclass(frozen=True)
class _Committed:
    """Parts of split batches the service committed before a later part failed: one producer instance's
    events in the ``(first_seq, last_seq)`` ranges (a part's rows are the batch's rows in that range),
    and the commits' result not yet reported to the writer."""

    instance: str
    ranges: tuple[tuple[int, int], ...]
    result: AppendResult


class HttpSink:
    """A :class:`~kvtrail.audit.contract.Sink` posting batches to a kvtrail service (``url`` is its base URL).

    Used by one writer thread, like any sink; ``close`` releases the connection pool.
    """

    def __init__(
        self,
        url: str,
        token: str,
        config: HttpSinkConfig = HttpSinkConfig(),
        *,
        transport: httpx.BaseTransport | None = None,
    ):
        if not is_url(url):
            raise ValueError(f"url: {url!r} is not an http:// or https:// URL")
        self.url = url.rstrip("/")
        self.config = config
        self._done: _Committed | None = None
        self.sent_requests = 0
        self.retried_requests = 0
        self._client = httpx.Client(
            base_url=self.url,
            transport=transport,
            headers={"Authorization": f"Bearer {token}", "Content-Type": ARROW_STREAM},
            timeout=httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s),
        )

    @classmethod
    def from_url(cls, url: str, token: str | None = None) -> HttpSink:
        """A sink for ``url``, with ``token`` or else the ``KVTRAIL_TOKEN`` environment variable."""
        token = token if token is not None else os.environ.get(TOKEN_ENV)
        if not token:
            raise ValueError(f"token: a service URL needs a producer token (pass one, or set {TOKEN_ENV})")
        return cls(url, token)

    def append(self, table: pa.Table) -> AppendResult:
        done = self._done
        sent: np.ndarray | None = None  # the rows sent, where some were left out
        if done is not None and table.num_rows:  # leave out what a split already committed
            seq = table.column("seq")
            stored = pa.repeat(pa.scalar(False), table.num_rows)
            for first, last in done.ranges:
                stored = pc.or_(stored, pc.and_(pc.greater_equal(seq, first), pc.less_equal(seq, last)))
            stored = pc.and_(stored, pc.equal(table.column("instance"), done.instance))
            keep = pc.invert(stored).to_numpy(zero_copy_only=False)
            if not keep.all():
                table, sent = table.filter(pa.array(keep)), np.flatnonzero(keep)
        try:
            result = self._send(table) if table.num_rows else AppendResult(0, 0, 0, ())
        except ValidationError as exc:
            if sent is None:
                raise
            raise exc.moved(sent) from None  # its positions were the sent table's
        if done is not None and self._done is done:  # the writer is told of the earlier part now
            self._done = None
            result = _sum(done.result, result)
        return result

    def _send(self, table: pa.Table) -> AppendResult:
        reply = self._post(write_ipc(wire_table(table)))
        if reply.status_code == 200:
            j = reply.json()
            batch = (int(j["producer_id"]), int(j["batch_no"]))
            return AppendResult(int(j["events"]), int(j["page_events"]), 0, (batch,))
        if reply.status_code == 422:
            errors = reply.json().get("errors") or [{}]
            e = errors[0]
            raise ValidationError(
                str(e.get("field", "(batch)")),
                str(e.get("reason", "refused by the service")),
                event=e.get("event"),
                kind=e.get("kind"),
                events=_positions(e.get("events"), table.num_rows),
            )
        if reply.status_code == 413 and table.num_rows > 1:
            half = table.num_rows // 2
            first = self._send(table.slice(0, half))
            try:
                second = self._send(table.slice(half))
            except ValidationError as exc:
                self._committed(table.slice(0, half), first)
                raise exc.moved(range(half, table.num_rows)) from None
            except Exception:
                self._committed(table.slice(0, half), first)
                raise
            return _sum(first, second)
        raise StoreError(f"service {self.url}: HTTP {reply.status_code}: {_detail(reply)}")

    def _committed(self, part: pa.Table, result: AppendResult) -> None:
        """Remember ``part`` of a split batch as committed (with what was already remembered, the part
        before it), until a later append reports it to the writer."""
        seq = part.column("seq")
        span = ((pc.min(seq).as_py(), pc.max(seq).as_py()),)
        instance = part.column("instance")[0].as_py()
        done = self._done
        if done is not None and done.instance == instance:
            span, result = done.ranges + span, _sum(done.result, result)
        self._done = _Committed(instance, span, result)

    def _post(self, body: bytes) -> httpx.Response:
        delay = self.config.backoff_s
        failure = ""
        for attempt in range(self.config.retries + 1):
            if attempt:
                self.retried_requests += 1
                time.sleep(delay)
                delay *= 2
            self.sent_requests += 1
            try:
                reply = self._client.post(INGEST_PATH, content=body)
            except httpx.TransportError as exc:
                failure = f"{type(exc).__name__}: {exc}"
                continue
            if reply.status_code < 500:
                return reply
            failure = f"HTTP {reply.status_code}: {_detail(reply)}"
        raise StoreError(f"service {self.url} unavailable after {self.config.retries + 1} attempts: {failure}")

    def close(self) -> None:
        self._client.close()
