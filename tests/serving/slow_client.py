"""A bounded slow HTTP client: sends pieces one at a time, a fixed interval apart, and stops when the server
answers and closes (or after the last piece). Every loop has a bound."""

from __future__ import annotations

import select
import socket
from dataclasses import dataclass


@dataclass
class SlowResult:
    received: bytes  # what the server sent
    pieces_sent: int  # how many pieces went out before the server closed
    closed: bool  # whether the server closed the connection


def send_slowly(port: int, pieces: list[bytes], interval_s: float) -> SlowResult:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    received, sent, closed = b"", 0, False
    try:
        for piece in pieces:
            try:
                sock.sendall(piece)
            except OSError:  # the server closed while we sent
                closed = True
                break
            sent += 1
            readable, _, _ = select.select([sock], [], [], interval_s)
            if readable:
                received, closed = _drain(sock, received)
                if closed:
                    break
        if not closed:
            received, closed = _drain(sock, received, wait_s=interval_s)
    finally:
        sock.close()
    return SlowResult(received, sent, closed)


def _drain(sock: socket.socket, received: bytes, wait_s: float = 2.0) -> tuple[bytes, bool]:
    """Read what the server sent until it closes (True) or nothing more comes within ``wait_s`` (False)."""
    for _ in range(1000):
        readable, _, _ = select.select([sock], [], [], wait_s)
        if not readable:
            return received, False
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            return received, True
        if not data:
            return received, True
        received += data
    return received, False


def half_sent(port: int, count: int, wait_s: float) -> list[bytes | None]:
    """Open ``count`` connections that each send part of a request's headers and nothing more; what each
    received before the server closed it, within ``wait_s`` in all (None: still open)."""
    socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(count)]
    try:
        for s in socks:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        out: list[bytes | None] = []
        for s in socks:
            got, closed = _drain(s, b"", wait_s=wait_s)
            out.append(got if closed else None)
            wait_s = 0.5  # the others had the same time meanwhile
        return out
    finally:
        for s in socks:
            s.close()
