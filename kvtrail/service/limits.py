"""``QueryLimiter``: how many queries one token, and all tokens together, may have running and waiting.

A query beyond its token's running and waiting bounds is answered 429 with ``Retry-After`` at once, before
any work (or a thread) is spent on it. Waiting queries wait on the event loop, not in a worker thread, and
the queries of all tokens together run on at most ``total`` of the thread pool's 40 threads, so the ingest
route, which parses in that pool too, always finds one: queries cannot starve ingest acks. A token is told
apart by its ``Authorization`` header (hashed), before it is checked, so a flood of bad tokens is bounded
like any other."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class QueryLimits:
    """Queries of one token running at once and waiting beyond those, queries of all tokens running at once,
    and the ``Retry-After`` (seconds) of a 429."""

    per_token: int = 4
    queue_per_token: int = 16
    total: int = 16  # below the thread pool's 40 threads, which ingest shares
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        for name in ("per_token", "total", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.queue_per_token < 0:
            raise ValueError(f"queue_per_token: must be >= 0, got {self.queue_per_token}")


class TooManyQueries(Exception):
    """The token's running and waiting queries are at their bounds (a 429)."""


@dataclass
class _Waiter:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


class QueryLimiter:
    """Slots for running queries, per token and in total, handed to waiters in the order they came. Thread-safe
    (the counters are shared by every event loop that serves the application)."""

    def __init__(self, limits: QueryLimits | None = None):
        self.limits = limits or QueryLimits()
        self._lock = threading.Lock()
        self._running: dict[str, int] = {}
        self._waiting: dict[str, deque[_Waiter]] = {}
        self._total = 0
        self.refused = 0  # 429s answered since the service started

    @staticmethod
    def key(authorization: str | None) -> str:
        return hashlib.sha256((authorization or "").encode()).hexdigest()

    def _free(self, key: str) -> bool:
        return self._running.get(key, 0) < self.limits.per_token and self._total < self.limits.total

    def _take(self, key: str) -> None:
        self._running[key] = self._running.get(key, 0) + 1
        self._total += 1

    async def acquire(self, key: str) -> None:
        """A running slot for ``key``: at once, after waiting, or TooManyQueries when its queue is full."""
        with self._lock:
            if self._free(key) and not self._waiting.get(key):
                self._take(key)
                return
            queue = self._waiting.setdefault(key, deque())
            if len(queue) >= self.limits.queue_per_token:
                self.refused += 1
                raise TooManyQueries
            waiter = _Waiter(asyncio.get_running_loop(), asyncio.get_running_loop().create_future())
            queue.append(waiter)
        try:
            await waiter.future
        except asyncio.CancelledError:  # the client went away while it waited
            with self._lock:
                if waiter in queue:
                    queue.remove(waiter)
                    return_slot = False
                else:
                    return_slot = True  # it was handed a slot in the same moment
            if return_slot:
                self.release(key)
            raise

    def release(self, key: str) -> None:
        """Give back ``key``'s slot; hand free slots to the first waiters whose token has room."""
        with self._lock:
            self._running[key] -= 1
            self._total -= 1
            if not self._running[key]:
                del self._running[key]
            for k in list(self._waiting):
                queue = self._waiting[k]
                while queue and self._free(k):
                    waiter = queue.popleft()
                    self._take(k)
                    waiter.loop.call_soon_threadsafe(_grant, waiter.future)
                if not queue:
                    del self._waiting[k]


def _grant(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
