"""The service's one ingest writer: every accepted batch is committed by one thread, in arrival order.

DuckDB lets one connection write at a time, and the store's chain needs its batches in order, so the
request handlers hand their parsed batches to :class:`Committer` and wait for the result. The thread
takes everything queued at once (a group commit, as the relay does): the batches of different producers
are validated one by one and committed in one transaction (``AuditStore.append_validated``), two batches
of one producer never are, so each request stays exactly one stored batch (with the digest it would have
alone) and a re-sent batch can be recognised by its sequence range.

A batch whose producer and seq range equal a stored batch's is a re-send (a retry after a lost
reply): it is acknowledged with the stored batch's numbers and stored nothing. A range that overlaps
stored batches in any other way is a :class:`ConflictError`.

When nothing arrives for ``IDLE_TICK_S`` the thread asks the store's checkpoint policy once more (under
the write lock): the last commits before a quiet spell, and what the other writers wrote (tokens, the
access log, the judge's tables), reach the main file within the policy's interval, not at the next batch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow as pa

from kvtrail.audit.store import AuditStore
from kvtrail.audit.validate import Prechecked
from kvtrail.errors import KvtrailError, ValidationError

log = logging.getLogger("kvtrail.service")
MAX_GROUP_EVENTS = 1_000_000  # bounds one transaction's memory when many producers send at once
IDLE_TICK_S = 1.0  # the writer's idle tick: how often a quiet writer asks the checkpoint policy


class ConflictError(KvtrailError):
    """A batch's seq range overlaps stored batches of its producer without being one of them."""

    http_status = 409


class CommitFailed(KvtrailError):
    """The store failed to commit (or the service is stopping): nothing of the batch was stored."""

    http_status = 503


@dataclass(frozen=True)
class IngestReply:
    """The stored batch a request became (or, for a re-send, already was): what `POST /v1/events` replies."""

    producer_id: int
    batch_no: int
    first_seq: int
    last_seq: int
    events: int
    page_events: int
    digest: str
    duplicate: bool


@dataclass
class _Pending:
    table: pa.Table
    producer_id: int
    first_seq: int
    last_seq: int
    in_order: bool  # seq strictly increasing (else validation refuses it, and it is never a re-send)
    future: Future
    pre: Prechecked | None = None  # the batch as prechecked where it arrived


def _settle(fut: Future, result: IngestReply) -> None:
    if not fut.done():  # a future is settled once; after a failed group the done ones are left as they are
        fut.set_result(result)


def _fail(fut: Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


_SELECT = "SELECT batch_no, first_seq, last_seq, num_events, num_page_events, digest FROM batches"


class Committer:
    """The ingest writer thread of one store. ``submit`` is thread-safe; the rest runs on the thread.

    ``write_lock`` is held around every commit, so the other writers that hold it (tokens, access log)
    never interleave with one. ``on_commit(monotonic_ns, table, batches)`` is called
    after each commit that stored something (the live judge's wake-up), with the committed events as
    validated and {producer_id: batch_no} of the batches they form.
    """

    def __init__(
        self,
        store: AuditStore,
        write_lock: threading.Lock,
        *,
        on_commit: Callable[[int, pa.Table | None, dict[int, int]], None] | None = None,
    ):
        self.store = store
        self.write_lock = write_lock
        self.on_commit = on_commit
        self.committed_batches = 0
        self.committed_events = 0
        self.duplicates = 0
        self.transactions = 0
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._closed = False
        self._submit_lock = threading.Lock()
        with write_lock:
            rows = store.con.execute("SELECT producer_id, max(last_seq) FROM batches GROUP BY producer_id").fetchall()
        self._last_seq: dict[int, int] = {int(p): int(s) for p, s in rows}
        with write_lock:
            rows = store.con.execute("SELECT producer_id, max(batch_no) FROM batches GROUP BY producer_id").fetchall()
        self.heads: dict[int, int] = {int(p): int(n) for p, n in rows}  # the last acknowledged batch of each
        self._thread = threading.Thread(target=self._run, name="kvtrail-service-commit", daemon=True)
        self._thread.start()

    def submit(self, table: pa.Table | Prechecked, producer_id: int, seq: np.ndarray) -> Future[IngestReply]:
        """Queue one producer's batch (``seq``: its events' sequence numbers, at least one; ``table`` may be
        prechecked, :func:`~kvtrail.audit.validate.precheck_batch`, so the writer checks only what depends on
        the store); the future holds its :class:`IngestReply` or the error that refused it (ValidationError,
        ConflictError, CommitFailed)."""
        fut: Future[IngestReply] = Future()
        in_order = bool((seq[1:] > seq[:-1]).all())
        pre = table if isinstance(table, Prechecked) else None
        item = _Pending(
            table.table if pre is not None else table, producer_id, int(seq.min()), int(seq.max()), in_order, fut, pre
        )
        with self._submit_lock:
            if self._closed:
                fut.set_exception(CommitFailed("the service is shutting down"))
                return fut
            self._queue.put(item)
        return fut

    def close(self, timeout_s: float = 30.0) -> None:
        """IngestReply what is queued, then stop the thread. Later submits fail with CommitFailed."""
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout_s)

    # ---- the writer thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=IDLE_TICK_S)
            except queue.Empty:
                self._idle_tick()
                continue
            if item is None:
                return
            group, held, stop = [item], [], False
            seen, events = {item.producer_id}, item.table.num_rows
            while events < MAX_GROUP_EVENTS:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                if nxt.producer_id in seen:  # one stored batch per request: never two of a producer together
                    held.append(nxt)
                    continue
                seen.add(nxt.producer_id)
                group.append(nxt)
                events += nxt.table.num_rows
            self._commit_group(group)
            for h in held:  # in arrival order, so a producer's batches keep their order
                self._commit_group([h])
            if stop:
                return

    def _idle_tick(self) -> None:
        try:
            with self.write_lock:
                self.store.maybe_checkpoint()  # a failed checkpoint is logged there and tried again later
        except Exception:  # noqa: BLE001 - a closed or failed store: the next commit says so
            log.debug("kvtrail service: idle checkpoint check failed", exc_info=True)

    def _commit_group(self, group: list[_Pending]) -> None:
        try:
            with self.write_lock:
                fresh = [p for p in group if not self._resolved_as_stored(p)]
                if fresh:
                    self._append(fresh)
        except Exception as exc:  # noqa: BLE001 - every waiting request is told; the service keeps running
            log.exception("kvtrail service: commit failed")
            for p in group:
                _fail(p.future, CommitFailed(f"store failed: {type(exc).__name__}: {exc}"))

    def _resolved_as_stored(self, p: _Pending) -> bool:
        """Answer a re-send or a conflicting range from the stored batches; False if the batch is new."""
        last = self._last_seq.get(p.producer_id)
        if last is None or p.first_seq > last or not p.in_order:
            return False
        rows = self.store.con.execute(
            f"{_SELECT} WHERE producer_id = ? AND first_seq <= ? AND last_seq >= ? ORDER BY batch_no",
            [p.producer_id, p.last_seq, p.first_seq],
        ).fetchall()
        if not rows:
            return False  # below the last stored seq but in no batch: validation refuses it
        no, first, last_seq, n, pages, digest = rows[0]
        if len(rows) == 1 and (first, last_seq, n) == (p.first_seq, p.last_seq, p.table.num_rows):
            self.duplicates += 1
            _settle(
                p.future,
                IngestReply(
                    p.producer_id, int(no), int(first), int(last_seq), int(n), int(pages), bytes(digest).hex(), True
                ),
            )
            return True
        spans = ", ".join(f"batch {r[0]} (seq {r[1]}..{r[2]})" for r in rows[:3])
        _fail(
            p.future,
            ConflictError(
                f"seq {p.first_seq}..{p.last_seq} overlaps stored {spans} of producer {p.producer_id} "
                "without being one of them"
            ),
        )
        return True

    def _append(self, group: list[_Pending]) -> None:
        # A group commit: each batch is validated alone (a bad one is refused alone), then the good ones,
        # each of another producer, are committed in one transaction; each stays its own stored batch.
        good, checked = [], []
        for p in group:
            try:
                checked.append(self.store.validate(p.table if p.pre is None else p.pre))
            except ValidationError as exc:
                _fail(p.future, exc)
                continue
            good.append(p)
        if good:
            res = self.store.append_validated(checked)
            self._reply(good, dict(res.batches), res.table)

    def _reply(self, group: list[_Pending], committed: dict[int, int], table: pa.Table | None) -> None:
        now = time.monotonic_ns()
        keys = [(p.producer_id, committed[p.producer_id]) for p in group]
        where = " OR ".join("(producer_id = ? AND batch_no = ?)" for _ in keys)
        rows = self.store.con.execute(
            f"SELECT producer_id, {_SELECT.removeprefix('SELECT ')} WHERE {where}", [x for k in keys for x in k]
        ).fetchall()
        by_key = {(int(r[0]), int(r[1])): r for r in rows}
        self.transactions += 1
        self.heads.update(committed)  # before any reply: a producer told "committed" finds it in the heads
        for p, key in zip(group, keys):
            _, no, first, last, n, pages, digest = by_key[key]
            self._last_seq[p.producer_id] = int(last)
            self.committed_batches += 1
            self.committed_events += int(n)
            _settle(
                p.future,
                IngestReply(
                    p.producer_id, int(no), int(first), int(last), int(n), int(pages), bytes(digest).hex(), False
                ),
            )
        if self.on_commit is not None:
            self.on_commit(now, table, committed)
