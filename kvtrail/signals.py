"""Stop signals: SIGTERM is handled like SIGINT (Ctrl-C) by every long-running kvtrail command.

``docker stop`` sends SIGTERM to the container's first process; ``systemctl stop`` sends it to every
process of the unit. The process that owns the store (the router, ``kvtrail stack``) turns either
signal into :class:`KeyboardInterrupt` in its main thread, so one path runs for both: stop accepting,
drain the requests in flight (bounded), close every recorder (each writes ``recorder_closed``), close
the store. While that runs a second signal is ignored, so it cannot cut the flush short. Workers
ignore both signals: the router stops them once their in-flight requests are drained, and a signal
sent to the whole process group must not take them down before that. ``kvtrail forensics watch`` stops
polling on either signal the same way.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _interrupt(signum: int, _frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _in_main_thread() -> bool:
    # Python installs signal handlers only from the main thread (tests may run a stack elsewhere).
    return threading.current_thread() is threading.main_thread()


@contextmanager
def _handlers(handler) -> Iterator[None]:
    if not _in_main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def interrupt_on_stop_signals():
    """Within the block, SIGINT and SIGTERM raise KeyboardInterrupt in the main thread."""
    return _handlers(_interrupt)


def stop_signals_ignored():
    """Within the block, SIGINT and SIGTERM are ignored (a shutdown in progress runs to its end)."""
    return _handlers(signal.SIG_IGN)


def ignore_stop_signals() -> None:
    """For a worker process: ignore SIGINT and SIGTERM for good; the router decides when it stops."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
