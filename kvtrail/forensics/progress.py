"""How far a long read has come, for a face to show: the replay's reader reports each slice of events it
hands on to whoever watches (:func:`watching`), in this thread's context; nobody watching costs a lookup.

A context variable, not an argument threaded through every question: the questions, the report and the
findings' save keep their signatures, and a watcher sees only its own thread's work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

Watcher = Callable[[int], None]  # called with the number of events just read

_watcher: ContextVar[Watcher | None] = ContextVar("kvtrail_read_progress", default=None)


@contextmanager
def watching(watcher: Watcher) -> Iterator[None]:
    """Call ``watcher(n)`` with each slice of ``n`` events the replay reads inside this block."""
    token = _watcher.set(watcher)
    try:
        yield
    finally:
        _watcher.reset(token)


def advance(events: int) -> None:
    """Report ``events`` more read (the replay's reader calls this per slice)."""
    watcher = _watcher.get()
    if watcher is not None:
        watcher(events)
