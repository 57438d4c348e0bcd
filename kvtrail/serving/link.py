"""The router's side of the control channel to one worker.

Messages are the typed dataclasses of :mod:`kvtrail.serving.messages` over ``multiprocessing.connection``
sockets on 127.0.0.1 with an auth key. :class:`WorkerLink` has one reader thread that matches each
reply to the callers waiting for its type and transfer id, and fails every waiter at once if the
worker goes away (or sends something the router does not take).
"""

from __future__ import annotations

import asyncio
import threading
from multiprocessing.connection import Connection

from kvtrail.errors import KvtrailError
from kvtrail.serving.messages import ROUTER_INBOX, RouterReply, unexpected


class WorkerDown(KvtrailError):
    """The worker process closed its channel (crashed or was killed)."""

    http_status = 502


class WorkerLink:
    """Router-side handle of one worker: send a message, await the reply for its transfer id."""

    def __init__(self, name: str, conn: Connection):
        self.name = name
        self._conn = conn
        self._send_lock = threading.Lock()
        # transfer id -> [(reply types accepted, loop, future)]
        self._waiters: dict[int, list[tuple[tuple[type, ...], asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self._lock = threading.Lock()
        self.alive = True
        self._reader = threading.Thread(target=self._read, name=f"kvtrail-link-{name}", daemon=True)
        self._reader.start()

    def send(self, msg: object) -> None:
        if not self.alive:
            raise WorkerDown(f"{self.name} worker is down")
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, EOFError, BrokenPipeError):
            self.alive = False
            raise WorkerDown(f"{self.name} worker is down") from None

    def expect(self, transfer_id: int, *kinds: type) -> asyncio.Future:
        """A future resolved with the next reply for ``transfer_id`` whose type is one of ``kinds``."""
        if not kinds or not all(k in ROUTER_INBOX for k in kinds):
            raise ValueError(f"kinds: {kinds!r} must be reply types of kvtrail.serving.messages (ROUTER_INBOX)")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        # A request that fails on one worker never awaits what it expected of the other: the WorkerDown
        # that future then gets is the request's story already, not an error of its own to log.
        fut.add_done_callback(_retrieve)
        with self._lock:
            if not self.alive:
                fut.set_exception(WorkerDown(f"{self.name} worker is down"))
                return fut
            self._waiters.setdefault(transfer_id, []).append((kinds, loop, fut))
        return fut

    def _read(self) -> None:
        error: KvtrailError = WorkerDown(f"{self.name} worker is down")
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            if not isinstance(msg, RouterReply):
                error = unexpected(f"router (from the {self.name} worker)", msg)
                self._conn.close()  # the worker sees the router gone and exits its loop
                break
            with self._lock:
                waiting = self._waiters.get(msg.room, [])
                matched = [w for w in waiting if isinstance(msg, w[0])]
                rest = [w for w in waiting if not isinstance(msg, w[0])]
                if rest:
                    self._waiters[msg.room] = rest
                else:
                    self._waiters.pop(msg.room, None)
            for _, loop, fut in matched:
                loop.call_soon_threadsafe(_resolve, fut, msg)
        self.alive = False
        with self._lock:
            pending, self._waiters = self._waiters, {}
        for waiters in pending.values():
            for _, loop, fut in waiters:
                loop.call_soon_threadsafe(_fail, fut, error)

    def close(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass
        self._reader.join(5)


def _resolve(fut: asyncio.Future, msg) -> None:
    if not fut.done():
        fut.set_result(msg)


def _retrieve(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


def _fail(fut: asyncio.Future, exc: Exception) -> None:
    if not fut.done():
        fut.set_exception(exc)
