"""``ReadTimeouts``: how long an HTTP client may take to send a request's headers and its body.

uvicorn bounds only the idle time between two requests on a kept-alive connection; a client that sends
one header line, or one body byte, every few seconds holds its connection (and a body buffer) for ever,
and a thousand such clients hold a thousand. :func:`deadline_protocol` gives uvicorn's h11 protocol two
deadlines: the headers must be complete within ``header_s`` of the connection opening (or of the next
request's first byte on a kept-alive one), and the body within ``body_s`` of the headers. Past either,
the client gets ``408 Request Timeout`` and the connection is closed; the handler of a request whose
body stopped sees a disconnect. How long the application then takes to answer is not bounded here.
Both ``kvtrail serve`` and the reference stack's router serve with it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

_RESPONSE_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s"
)


@dataclass(frozen=True)
class ReadTimeouts:
    """Seconds a client has for a request's headers (from its first byte, or the connection's opening) and
    for its body (from the end of its headers)."""

    header_s: float = 10.0
    body_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("header_s", "body_s"):
            value = getattr(self, name)
            if not 0 < value <= 3600:
                raise ValueError(f"{name}: must be in (0, 3600] seconds, got {value}")


def _answer_408(transport: asyncio.Transport, what: str, seconds: float) -> None:
    body = b'{"detail": "request %s not received within %g s"}' % (what.encode(), seconds)
    transport.write(_RESPONSE_408 % (len(body), body))
    transport.close()


def deadline_protocol(timeouts: ReadTimeouts) -> type:
    """uvicorn's h11 protocol class with ``timeouts`` on reading each request (``uvicorn.Config(http=...)``)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class DeadlineH11Protocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _phase = "headers"  # what the armed timer waits for: "headers", "body", or "" (the app has it all)

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm("headers", timeouts.header_s)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._between_requests() and self._timer is None:
                self._arm("headers", timeouts.header_s)  # the next request on a kept-alive connection
            super().data_received(data)
            self._progress()

        def on_response_complete(self) -> None:
            self._disarm()
            super().on_response_complete()
            self._progress()  # a pipelined request may have started

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _progress(self) -> None:
            if self._between_requests() or self.transport.is_closing():
                return
            if not self.cycle.more_body:  # the whole request is in: the rest is the application's time
                self._disarm()
            elif self._phase == "headers":
                self._arm("body", timeouts.body_s)

        def _arm(self, phase: str, seconds: float) -> None:
            self._disarm()
            self._phase = phase
            self._timer = self.loop.call_later(seconds, self._expired, phase, seconds)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._phase = "headers" if self._between_requests() else ""

        def _expired(self, phase: str, seconds: float) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if phase == "body" and cycle is not None:
                if cycle.response_started:  # the application answered without the body: let it finish
                    return
                cycle.disconnected = True  # the handler's next read sees a disconnect; its answer goes nowhere
                cycle.message_event.set()
            _answer_408(self.transport, phase, seconds)

    return DeadlineH11Protocol
