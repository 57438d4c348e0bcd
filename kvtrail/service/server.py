"""``kvtrail serve``: the service process. It owns the store, serves HTTP with uvicorn, stops cleanly.

Start-up opens the store for writing (another process holding it is refused before anything is bound),
binds the socket itself (loopback and a port the OS picks by default) and reports the bound address
before serving, so the first line a supervisor reads is where to connect. SIGTERM and SIGINT stop
accepting, let the requests in flight finish (their batches commit; bounded by ``drain_timeout_s``),
then the committer drains, the judge judges what is left, and the store is checkpointed and closed.
A second signal during that close is ignored, so it cannot cut the flush short.
"""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path
from typing import Callable

import pyarrow as pa
import uvicorn

from kvtrail.alerts.otel import OtelExport, otlp_export
from kvtrail.audit.chain import Signer
from kvtrail.service.app import create_app
from kvtrail.service.config import ServeConfig
from kvtrail.service.state import open_state
from kvtrail.serving.deadlines import deadline_protocol
from kvtrail.signals import stop_signals_ignored


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (IPv6 for an address with ':')."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def service_memory_pool() -> str:
    """Arrow's buffers in this process come from the C library's allocator, unless
    ``ARROW_DEFAULT_MEMORY_POOL`` names a pool; returns the pool's name.

    In the service one thread makes most buffers (a request worker decodes a body, the committer cuts a
    commit) and another frees them (the judge, after the commit is judged). Arrow's default pool,
    mimalloc, gives a block freed by another thread back to its owner only when that owner allocates
    again, and hands memory it does not reuse back to the OS; so the service kept asking the kernel for
    fresh zeroed pages, about 10 ms of system time per batch that direct append, freeing on the thread
    that allocated, does not spend. The C library's allocator reuses such memory at once."""
    if os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        return pa.default_memory_pool().backend_name
    pa.set_memory_pool(pa.system_memory_pool())
    return "system"


def run_service(
    db: str | Path,
    config: ServeConfig | None = None,
    *,
    tokens_file: str | Path | None = None,
    ready: Callable[[str], None] = print,
    export: OtelExport | None = None,
) -> None:
    """Serve the store at ``db`` until SIGTERM or SIGINT; ``ready(url)`` is called once it is listening.
    ``export``: where the judge's results go as OpenTelemetry (else ``config.otlp_endpoint``'s, if set)."""
    config = config or ServeConfig()
    service_memory_pool()
    signer = Signer.from_file(config.signing_key) if config.signing_key else None  # a bad key fails first
    if export is None and config.otlp_endpoint is not None:
        export = otlp_export(config.otlp_endpoint)  # OtelMissing without the extra, before the store is opened
    try:
        state = open_state(
            db,
            tokens_file=tokens_file,
            judge_interval_s=config.judge_interval_s,
            export=export,
            query_limits=config.query_limits,
            memory_limit_mb=config.memory_limit_mb,
            judge_horizon_s=config.judge_horizon_s,
        )
    except BaseException:
        if export is not None:
            export.close(0)
        raise
    state.checkpoint_signer = signer
    try:
        app = create_app(state, max_body_bytes=config.max_body_bytes, metrics_token=config.metrics_token)
        sock = bind(config.host, config.port)
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                log_level="warning",
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=math.ceil(config.drain_timeout_s),
                http=deadline_protocol(config.read_timeouts),
            )
        )
        # uvicorn handles both signals while it runs and raises the caught one again after it stops;
        # with both ignored around it that second raise, and any signal during the close, do nothing.
        with stop_signals_ignored():
            ready(url_of(sock))
            try:
                server.run(sockets=[sock])
            finally:
                sock.close()
                state.close(config.drain_timeout_s)
    finally:
        state.close(config.drain_timeout_s)
