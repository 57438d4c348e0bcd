"""``kvtrail witness serve``: ``POST /add-checkpoint`` as c2sp.org/tlog-witness defines it, over the
standard library's HTTP server (no extra needed, so a second team or a tenant can run it anywhere).

200 with the cosignature line; 409 (``text/x.tlog.size``, the recorded size) when ``old`` is not the
recorded size, on a rollback and on another root at the same size; 422 when the consistency proof fails;
403 when no trusted log key signed the checkpoint; 400 for a malformed body; 413 past the body limit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvtrail.audit.witness import Refused, Witness, parse_add_checkpoint
from kvtrail.errors import KvtrailError

MAX_BODY_BYTES = 1 << 20
BANNER = "kvtrail witness listening on {url}"


def make_server(witness: Witness, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A bound (not yet serving) HTTP server for ``witness``; ``server_address`` names the port."""

    class Handler(BaseHTTPRequestHandler):
        server_version = "kvtrail-witness"

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
            pass  # no access log on stderr

        def _reply(self, status: int, text: str, content_type: str = "text/plain; charset=utf-8") -> None:
            data = text.encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._reply(404 if self.path != "/" else 200, f"{witness.name}\n" if self.path == "/" else "not found\n")

        def do_POST(self) -> None:  # noqa: N802
            if self.path.rstrip("/") != "/add-checkpoint":
                self._reply(404, "not found\n")
                return
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self._reply(411, "Content-Length required\n")
                return
            if not 0 <= length <= MAX_BODY_BYTES:
                self._reply(413, f"body larger than {MAX_BODY_BYTES} bytes\n")
                return
            body = self.rfile.read(length)
            try:
                old, proof, note = parse_add_checkpoint(body)
                line = witness.add_checkpoint(note, old, proof)
            except Refused as exc:
                if exc.status == 409 and exc.recorded_size is not None:
                    self._reply(409, f"{exc.recorded_size}\n", "text/x.tlog.size")
                else:
                    self._reply(exc.status, f"{exc}\n")
                return
            except KvtrailError as exc:
                self._reply(400, f"{exc}\n")
                return
            self._reply(200, line.text())

    return ThreadingHTTPServer((host, port), Handler)


def url_of(server: ThreadingHTTPServer) -> str:
    host, port = server.server_address[:2]
    return f"http://{host!s}:{port}" if isinstance(host, str) else f"http://{host.decode()}:{port}"


def serve(witness: Witness, host: str, port: int, ready: Callable[[str], None]) -> None:
    """Serve until KeyboardInterrupt (SIGINT, or SIGTERM made one by the caller); ``ready(url)`` once bound."""
    server = make_server(witness, host, port)
    ready(url_of(server))
    try:
        server.serve_forever()
    finally:
        server.server_close()


def serve_in_thread(witness: Witness) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """For tests and embedding: a server on 127.0.0.1 port 0 running in a daemon thread."""
    server = make_server(witness)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread
