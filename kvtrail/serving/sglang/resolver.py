"""Resolver: the plugin's own worker thread, where snapshots taken in SGLang's hot loop become events.

A hook never syncs the device: it snapshots index tensors (:func:`snapshot`: a non-blocking
device-to-host copy into pinned memory plus a CUDA event, or a plain copy on CPU) and hands a job to
the resolver, whose thread waits for the copy, turns tensors into page lists and calls the recorder.
Every failure is counted by the hook name it came from; nothing raises into SGLang.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from typing import Any, Callable

import numpy as np

logger = logging.getLogger("kvtrail.sglang")

_STOP = object()


class Snapshot:
    """An index tensor copied off the hot path; :meth:`numpy` waits for the copy (writer thread only)."""

    __slots__ = ("host", "event")

    def __init__(self, host: Any, event: Any = None):
        self.host = host
        self.event = event

    def numpy(self) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()
        return np.asarray(self.host.numpy() if hasattr(self.host, "numpy") else self.host, dtype=np.int64)


def snapshot(t: Any) -> Snapshot:
    """Copy a tensor (or array) without a device sync: pinned non-blocking D2H on CUDA, a clone elsewhere."""
    if getattr(t, "is_cuda", False):
        import torch

        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        host.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return Snapshot(host, event)
    if hasattr(t, "clone"):
        return Snapshot(t.detach().clone())
    return Snapshot(np.array(t, dtype=np.int64, copy=True))


class Resolver:
    """Runs jobs off the hot path, in order, on one daemon thread; counts failures per hook."""

    def __init__(self, report_every_s: float = 1.0) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        # Called on this thread, at most every report_every_s, while failures are counted (gap events).
        self.on_failures: Callable[[], None] | None = None
        self._report_every_ns = int(report_every_s * 1e9)
        self._last_report_ns = 0
        self.failures: Counter[str] = Counter()
        self.first_error: dict[str, str] = {}
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvtrail-sglang-resolver", daemon=True)
        self._thread.start()

    def submit(self, hook: str, fn: Callable[..., None], *args: Any) -> None:
        self._q.put((hook, fn, args))

    def count_failure(self, hook: str, exc: BaseException) -> None:
        with self._lock:
            self.failures[hook] += 1
            self.first_error.setdefault(hook, f"{type(exc).__name__}: {exc}"[:200])
        if self.failures[hook] == 1:
            logger.warning("kvtrail: hook %s failed (counted, recorded as a gap): %r", hook, exc)

    def take_failures(self) -> list[tuple[str, int, str]]:
        """(hook, failures, first error) since the last call."""
        with self._lock:
            out = [(h, n, self.first_error.get(h, "")) for h, n in self.failures.items() if n]
            self.failures.clear()
            self.first_error.clear()
        return out

    def drain(self, timeout: float = 30.0) -> bool:
        """Wait until every job submitted so far ran; False on timeout."""
        done = threading.Event()
        self._q.put(("drain", done.set, ()))
        return done.wait(timeout)

    def stop(self) -> None:
        self._q.put(_STOP)
        self._thread.join(5.0)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            hook, fn, args = item
            try:
                fn(*args)
            except Exception as exc:  # noqa: BLE001 - an auditing failure must not stop the audit; counted
                self.count_failure(hook, exc)
            if self.failures and self.on_failures is not None:
                now = time.monotonic_ns()
                if now - self._last_report_ns >= self._report_every_ns:
                    self._last_report_ns = now
                    try:
                        self.on_failures()
                    except Exception as exc:  # noqa: BLE001 - reporting must not stop the audit; counted
                        self.count_failure("report_gaps", exc)
