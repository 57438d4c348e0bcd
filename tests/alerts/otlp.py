"""An OTLP/HTTP receiver for tests and benches: binds 127.0.0.1 port 0, decodes each request's protobuf
(``opentelemetry-proto``) and keeps the spans and log records with their resource and scope."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest, ExportLogsServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def value(v: AnyValue) -> Any:
    """An OTLP AnyValue as Python."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: value(kv.value) for kv in v.kvlist_value.values}
    return None if kind is None else getattr(v, kind)


def attrs(kvs) -> dict[str, Any]:
    return {kv.key: value(kv.value) for kv in kvs}


@dataclass
class Received:
    """What the receiver decoded: each span and log record as a dict (``attributes``, ``resource``, ...)."""

    spans: list[dict] = field(default_factory=list)
    logs: list[dict] = field(default_factory=list)
    requests: int = 0
    gate: threading.Event = field(default_factory=threading.Event)  # cleared: requests wait until it is set
    lock: threading.Lock = field(default_factory=threading.Lock)


def _handler(received: Received) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the stdlib's name
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            received.gate.wait(60)
            if self.path == "/v1/traces":
                req = ExportTraceServiceRequest.FromString(body)
                out = ExportTraceServiceResponse().SerializeToString()
                got = [
                    {
                        "name": s.name,
                        "attributes": attrs(s.attributes),
                        "start_ns": s.start_time_unix_nano,
                        "end_ns": s.end_time_unix_nano,
                        "status_code": s.status.code,
                        "resource": attrs(rs.resource.attributes),
                        "resource_schema_url": rs.schema_url,
                        "scope": ss.scope.name,
                        "scope_schema_url": ss.schema_url,
                    }
                    for rs in req.resource_spans
                    for ss in rs.scope_spans
                    for s in ss.spans
                ]
                into = received.spans
            elif self.path == "/v1/logs":
                lreq = ExportLogsServiceRequest.FromString(body)
                out = ExportLogsServiceResponse().SerializeToString()
                got = [
                    {
                        "body": value(r.body),
                        "attributes": attrs(r.attributes),
                        "time_ns": r.time_unix_nano,
                        "severity_text": r.severity_text,
                        "severity_number": r.severity_number,
                        "event_name": r.event_name,
                        "resource_schema_url": rl.schema_url,
                        "scope_schema_url": sl.schema_url,
                    }
                    for rl in lreq.resource_logs
                    for sl in rl.scope_logs
                    for r in sl.log_records
                ]
                into = received.logs
            else:
                self.send_response(404)
                self.end_headers()
                return
            with received.lock:
                into.extend(got)
                received.requests += 1
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            return None

    return Handler


@contextmanager
def otlp_receiver() -> Iterator[tuple[str, Received]]:
    """A receiver on 127.0.0.1 (port 0): yields its base URL and what it received."""
    received = Received()
    received.gate.set()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(received))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        received.gate.set()
        server.shutdown()
        server.server_close()
        thread.join(10)
