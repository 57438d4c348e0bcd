"""Control channel between the router and the workers (and between prefill and decode).

Messages are tuples ``(op, transfer_id, *fields)`` over ``multiprocessing.connection`` sockets on
127.0.0.1 with an auth key. :class:`WorkerLink` is the router's side: one reader thread matches
replies to waiting callers by transfer id, and fails every waiter at once if the worker goes away.
"""

from __future__ import annotations

import asyncio
import threading
from multiprocessing.connection import Connection

from kvtrail.errors import KvtrailError


class WorkerDown(KvtrailError):
    """The worker process closed its channel (crashed or was killed)."""

    http_status = 502


class WorkerLink:
    """Router-side handle of one worker: send a message, await the reply for its transfer id."""

    def __init__(self, name: str, conn: Connection):
        self.name = name
        self._conn = conn
        self._send_lock = threading.Lock()
        self._waiters: dict[tuple[str, int], list] = {}
        self._lock = threading.Lock()
        self.alive = True
        self._reader = threading.Thread(target=self._read, name=f"kvtrail-link-{name}", daemon=True)
        self._reader.start()

    def send(self, msg: tuple) -> None:
        if not self.alive:
            raise WorkerDown(f"{self.name} worker is down")
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, EOFError, BrokenPipeError):
            self.alive = False
            raise WorkerDown(f"{self.name} worker is down") from None

    def expect(self, kind: str, transfer_id: int) -> asyncio.Future:
        """A future resolved with the next message of ``kind`` (a reply group) for ``transfer_id``."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            if not self.alive:
                fut.set_exception(WorkerDown(f"{self.name} worker is down"))
                return fut
            self._waiters.setdefault((kind, transfer_id), []).append((loop, fut))
        return fut

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = REPLY_KINDS.get(msg[0], msg[0])
            with self._lock:
                waiters = self._waiters.pop((kind, msg[1]), [])
            for loop, fut in waiters:
                loop.call_soon_threadsafe(_resolve, fut, msg)
        self.alive = False
        with self._lock:
            pending, self._waiters = self._waiters, {}
        for waiters in pending.values():
            for loop, fut in waiters:
                loop.call_soon_threadsafe(_fail, fut, WorkerDown(f"{self.name} worker is down"))

    def close(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass
        self._reader.join(5)


# Replies grouped by what the router waits for: prefill answers "admission" with one of two messages.
REPLY_KINDS = {"admitted": "admission", "rejected": "admission", "response": "response"}


def _resolve(fut: asyncio.Future, msg) -> None:
    if not fut.done():
        fut.set_result(msg)


def _fail(fut: asyncio.Future, exc: Exception) -> None:
    if not fut.done():
        fut.set_exception(exc)
