"""OpenTelemetry export of the live judge's results: findings as OTLP log records, one span per judged response.

:class:`OtelExport` is the hook: the live judge hands it, after each poll, the findings it saved and the
events it judged (:meth:`OtelExport.judged`); a bounded queue takes them without waiting, and one thread
of its own turns them into log records and spans and hands those to the exporters it was given (any
OpenTelemetry SDK ``SpanExporter`` and ``LogRecordExporter``; :func:`otlp_export` makes the OTLP/HTTP ones of
``kvtrail serve --otlp-endpoint``). A full queue or a failed export drops records and counts them
(:meth:`OtelExport.stats`, ``kvtrail_otel_*`` on ``/metrics``): the export never blocks or fails the judge,
ingest or a query.

What leaves: a span per ``response_sent`` the judge was handed as committed (responses it read back from the
store - at start, or after falling behind - get none; their findings are exported all the same), named
``kvtrail.response``, from the request's arrival to its response, with its verdict (``kvtrail.affected``,
``kvtrail.finding.codes``, ``kvtrail.pages_read_foreign``, ``kvtrail.victim_count``) as of that poll; a log record
per new finding with its code, severity, node, request, pages and victim count. Never a victim's request
or tenant id, nor a finding's detail (it can name them): a pipeline scoped to one tenant may receive these.
``gen_ai.*`` attributes follow the GenAI semantic conventions of :data:`SCHEMA_URL` (not stable: pinned);
token usage only for a response that succeeded (2xx), never made up for a failed one. The SDK comes with
the ``otel`` extra; importing this module does not need it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.compute as pc
from prometheus_client.core import CounterMetricFamily, Metric

from kvtrail.errors import KvtrailError
from kvtrail.forensics import AFFECTED_CODES, NEVER_WRITTEN, Finding

log = logging.getLogger("kvtrail.service")
SCHEMA_URL = "https://opentelemetry.io/schemas/1.44.0"  # the conventions the gen_ai.* names below follow
SCOPE = "kvtrail"
EXTRA = "otel"  # pip install 'kvtrail[otel]'
MAX_QUEUED = 1024  # polls waiting for the export thread; past this a poll's records are dropped and counted
EXPORT_TIMEOUT_S = 10.0
SPAN_NAME = "kvtrail.response"
FINDING_EVENT = "kvtrail.finding"
_SEVERITY = {"critical": "FATAL", "high": "ERROR", "medium": "WARN"}


class OtelMissing(KvtrailError):
    """The OpenTelemetry SDK or its OTLP exporter is not installed."""


class BadEndpoint(KvtrailError, ValueError):
    """The OTLP endpoint is not an http(s) URL with a host."""


@dataclass(frozen=True)
class Verdict:
    """What the judge holds against one request."""

    codes: tuple[str, ...]
    pages_read_foreign: int
    victim_count: int

    @property
    def affected(self) -> bool:
        return any(c in AFFECTED_CODES for c in self.codes)


def verdicts(found: Sequence[Finding], request_ids: set[str]) -> dict[str, Verdict]:
    """The verdict of each of ``request_ids`` from the judge's findings (a request with none: clean)."""
    mine: dict[str, list[Finding]] = {}
    for f in found:
        if f.request_id in request_ids:
            mine.setdefault(f.request_id, []).append(f)
    out = {}
    for rid in request_ids:
        fs = mine.get(rid, [])
        foreign = {p for f in fs if f.code in AFFECTED_CODES for p in f.pages}
        victims = {v for f in fs for v in f.victim_request_ids if v is not None and v != NEVER_WRITTEN}
        out[rid] = Verdict(tuple(sorted({f.code for f in fs}, key=lambda c: int(c[1:]))), len(foreign), len(victims))
    return out


def response_attributes(row: dict, verdict: Verdict) -> dict[str, Any]:
    """A response's span attributes: ``gen_ai.*`` where the conventions define one, ``kvtrail.*`` for the rest."""
    status = int(row["http_status"])
    attrs: dict[str, Any] = {
        "gen_ai.response.id": row["request_id"],
        "http.response.status_code": status,
        "kvtrail.node": row["node"],
        "kvtrail.role": row["role"],
        "kvtrail.cluster": row["cluster"],
        "kvtrail.affected": verdict.affected,
        "kvtrail.finding.codes": list(verdict.codes),
        "kvtrail.pages_read_foreign": verdict.pages_read_foreign,
        "kvtrail.victim_count": verdict.victim_count,
    }
    if row.get("tenant_id") is not None:
        attrs["kvtrail.tenant_id"] = row["tenant_id"]
    if 200 <= status < 300:  # usage of a failed response is not known: none is sent
        attrs["gen_ai.usage.input_tokens"] = int(row["prompt_tokens"])
        attrs["gen_ai.usage.output_tokens"] = int(row["completion_tokens"])
        if row.get("ttft_ns") is not None:
            attrs["gen_ai.response.time_to_first_chunk"] = row["ttft_ns"] / 1e9
    else:
        attrs["error.type"] = str(status)
    if row.get("finish_reason") is not None:
        attrs["gen_ai.response.finish_reasons"] = [row["finish_reason"]]
    return attrs


def finding_attributes(f: Finding) -> dict[str, Any]:
    """A finding's log record attributes (no victim ids, no detail: see the module's docstring)."""
    attrs: dict[str, Any] = {
        "kvtrail.finding.code": f.code,
        "kvtrail.finding.title": f.title,
        "kvtrail.finding.severity": f.severity,
        "kvtrail.finding.num_pages": len(f.pages),
        "kvtrail.finding.first_ns": f.first_ns,
        "kvtrail.finding.last_ns": f.last_ns,
        "kvtrail.victim_count": len({v for v in f.victim_request_ids if v is not None and v != NEVER_WRITTEN}),
        "kvtrail.affected": f.code in AFFECTED_CODES,
    }
    for key, value in (
        ("kvtrail.node", f.node),
        ("gen_ai.response.id", f.request_id),
        ("kvtrail.tenant_id", f.tenant_id),
    ):
        if value is not None:
            attrs[key] = value
    return attrs


_RESPONSE_COLUMNS = (
    "cluster",
    "node",
    "role",
    "request_id",
    "tenant_id",
    "wall_ns",
    "http_status",
    "prompt_tokens",
    "completion_tokens",
    "latency_ns",
    "ttft_ns",
    "finish_reason",
)


def responses_of(tables: Sequence[pa.Table]) -> list[dict]:
    """The ``response_sent`` events of committed event tables, as dicts of the columns a span reads."""
    rows: list[dict] = []
    for t in tables:
        if "kind" not in t.column_names:
            continue
        sent = t.filter(pc.equal(t["kind"], "response_sent"))
        if sent.num_rows:
            cols = [c for c in _RESPONSE_COLUMNS if c in sent.column_names]
            rows.extend({**dict.fromkeys(_RESPONSE_COLUMNS), **r} for r in sent.select(cols).to_pylist())
    return rows


class OtelExport:
    """The judge's results to OpenTelemetry exporters, on a thread of its own (see the module's docstring).

    ``span_exporter`` / ``log_exporter``: SDK exporters (either may be None: that signal is not sent);
    ``resource``: attributes of the exporting service (``service.name`` defaults to ``kvtrail``)."""

    def __init__(
        self,
        span_exporter: Any = None,
        log_exporter: Any = None,
        *,
        resource: dict[str, Any] | None = None,
        max_queued: int = MAX_QUEUED,
    ):
        try:
            from opentelemetry.sdk._logs import LoggerProvider
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
        except ImportError as exc:
            raise OtelMissing(
                f"the OpenTelemetry export needs the '{EXTRA}' extra (pip install 'kvtrail[{EXTRA}]'): {exc}"
            ) from None
        self.span_exporter, self.log_exporter = span_exporter, log_exporter
        res = Resource.create({"service.name": "kvtrail", **(resource or {})}, schema_url=SCHEMA_URL)
        self._spans: list[Any] = []
        self._logs: list[Any] = []
        span_processor, log_processor = _processors(self._spans, self._logs)
        self._tracer_provider = TracerProvider(resource=res)
        self._tracer_provider.add_span_processor(span_processor)
        self._tracer = self._tracer_provider.get_tracer(SCOPE, schema_url=SCHEMA_URL)
        self._logger_provider = LoggerProvider(resource=res)
        self._logger_provider.add_log_record_processor(log_processor)
        self._logger = self._logger_provider.get_logger(SCOPE, schema_url=SCHEMA_URL)
        self._queue: queue.Queue[tuple[list[Finding], list[pa.Table], Sequence[Finding]] | None] = queue.Queue(
            max_queued
        )
        self._lock = threading.Lock()
        self.counts = {
            ("span", "exported"): 0,
            ("span", "dropped"): 0,
            ("log", "exported"): 0,
            ("log", "dropped"): 0,
        }
        self.dropped_polls = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvtrail-otel-export", daemon=True)
        self._thread.start()

    # ---- the judge's side: never waits ----------------------------------------------------------

    def judged(self, new_findings: list[Finding], tables: list[pa.Table], found: Sequence[Finding]) -> None:
        """One poll of the judge: the findings it saved, the committed event tables it was handed and every
        finding it holds (for the verdicts). Returns at once; a full queue drops the poll (counted)."""
        if self._closed or (not new_findings and not tables):
            return
        try:
            self._queue.put_nowait((list(new_findings), list(tables), found))
        except queue.Full:
            n_spans = len(responses_of(tables)) if self.span_exporter is not None else 0
            with self._lock:
                self.dropped_polls += 1
                self.counts[("span", "dropped")] += n_spans
                self.counts[("log", "dropped")] += len(new_findings) if self.log_exporter is not None else 0

    def stats(self) -> dict[str, int]:
        """Records exported and dropped, per signal (``span_exported``, ``log_dropped``, ...)."""
        with self._lock:
            return {f"{s}_{what}": n for (s, what), n in self.counts.items()}

    def close(self, timeout_s: float = EXPORT_TIMEOUT_S) -> None:
        """Export what is queued (bounded by ``timeout_s``), then shut the exporters down."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        for exporter in (self.span_exporter, self.log_exporter):
            if exporter is not None:
                exporter.shutdown()

    # ---- the export thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._export(*item)
            except Exception:  # noqa: BLE001 - an export failure must never reach the judge; counted and logged
                log.exception("kvtrail service: OpenTelemetry export failed")
                with self._lock:  # what the failed poll had built is not sent
                    self.counts[("span", "dropped")] += len(self._spans)
                    self.counts[("log", "dropped")] += len(self._logs)
                self._spans.clear()
                self._logs.clear()

    def _export(self, new_findings: list[Finding], tables: list[pa.Table], found: Sequence[Finding]) -> None:
        from opentelemetry.trace import Status, StatusCode

        if self.span_exporter is not None:
            rows = responses_of(tables)
            judged = verdicts(found, {r["request_id"] for r in rows})
            for r in rows:
                end = int(r["wall_ns"])
                span = self._tracer.start_span(
                    SPAN_NAME,
                    start_time=end - int(r["latency_ns"] or 0),
                    attributes=response_attributes(r, judged[r["request_id"]]),
                )
                if int(r["http_status"]) >= 400:
                    span.set_status(Status(StatusCode.ERROR, f"HTTP {r['http_status']}"))
                span.end(end_time=end)
            self._send("span", self.span_exporter, self._spans)
        if self.log_exporter is not None and new_findings:
            from opentelemetry._logs import SeverityNumber

            now = time.time_ns()
            for f in new_findings:
                text = _SEVERITY.get(f.severity, "WARN")
                self._logger.emit(
                    timestamp=f.last_ns,
                    observed_timestamp=now,
                    severity_number=SeverityNumber[text],
                    severity_text=text,
                    body=f"{f.code} {f.title} on {f.node or '(no node)'}",
                    attributes=finding_attributes(f),
                    event_name=FINDING_EVENT,
                )
            self._send("log", self.log_exporter, self._logs)

    def _send(self, signal: str, exporter: Any, pending: list[Any]) -> None:
        batch, pending[:] = list(pending), []
        if not batch:
            return
        try:
            ok = exporter.export(batch).name == "SUCCESS"
        except Exception:  # noqa: BLE001 - an exporter that raises is a failed export
            log.exception("kvtrail service: OpenTelemetry %s export raised", signal)
            ok = False
        with self._lock:
            self.counts[(signal, "exported" if ok else "dropped")] += len(batch)


def _processors(spans: list[Any], logs: list[Any]) -> tuple[Any, Any]:
    """A span processor and a log record processor that keep what ends or is emitted, for the export thread
    to send itself (the SDK's batch processors drop without counting)."""
    from opentelemetry.sdk._logs import LogRecordProcessor, ReadableLogRecord
    from opentelemetry.sdk.trace import SpanProcessor

    class CollectSpans(SpanProcessor):
        def on_end(self, span: Any) -> None:
            spans.append(span)

    class CollectLogs(LogRecordProcessor):
        def on_emit(self, log_record: Any) -> None:
            logs.append(
                ReadableLogRecord(
                    log_record=log_record.log_record,
                    resource=log_record.resource,
                    instrumentation_scope=log_record.instrumentation_scope,
                    limits=log_record.limits,
                )
            )

        def shutdown(self) -> None:
            return None

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return True

    return CollectSpans(), CollectLogs()


def check_endpoint(url: str) -> str:
    """``url`` without a trailing slash when it is an http(s) URL with a host, else BadEndpoint naming the flag."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadEndpoint(f"--otlp-endpoint: must be an http:// or https:// URL with a host, got {url!r}")
    return url.rstrip("/")


def otlp_export(endpoint: str, *, timeout_s: float = EXPORT_TIMEOUT_S, max_queued: int = MAX_QUEUED) -> OtelExport:
    """An :class:`OtelExport` to the OTLP/HTTP receiver at ``endpoint`` (its base URL: spans go to
    ``/v1/traces``, log records to ``/v1/logs``, as the OTLP exporters' base endpoint setting does)."""
    base = check_endpoint(endpoint)
    try:
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise OtelMissing(
            f"--otlp-endpoint needs the '{EXTRA}' extra (pip install 'kvtrail[{EXTRA}]'): {exc}"
        ) from None
    return OtelExport(
        OTLPSpanExporter(endpoint=base + "/v1/traces", timeout=timeout_s),
        OTLPLogExporter(endpoint=base + "/v1/logs", timeout=timeout_s),
        max_queued=max_queued,
    )


class ExportCollector:
    """``kvtrail_otel_exported_records_total`` and ``kvtrail_otel_dropped_records_total`` of one export."""

    def __init__(self, export: OtelExport):
        self._export = export

    def describe(self) -> Iterator[Metric]:
        return iter(())

    def collect(self) -> Iterator[Metric]:
        from kvtrail.alerts.metrics import BY_NAME

        counts = self._export.stats()
        for name, what in (("kvtrail_otel_exported_records", "exported"), ("kvtrail_otel_dropped_records", "dropped")):
            fam = CounterMetricFamily(name, BY_NAME[name].doc, labels=BY_NAME[name].labels)
            for signal in ("span", "log"):
                fam.add_metric([signal], counts[f"{signal}_{what}"])
            yield fam
