"""Answers from what the live judge holds: ``affected`` and ``findings`` without replaying the window.

The judge's replay has seen every batch it judged, from the first, so for a window that starts at or
before the store's first event and ends at or after the last one it judged, its findings are the ones
a replay of the window would find (those ending before ``from`` left out, as ``replay_store`` does).
:func:`judged_findings` waits (bounded) until the judge has judged at least the batches acknowledged
when the query came, then points the cursor at the store *as of the batches judged*
(:class:`SharedSnapshots`, one per judged state however many ask), so the SQL half of the answer (responses, gaps,
notes, warnings, exclusions) reads the same events the findings came from: the answer is the CLI's
answer on the store at that point. Any other window, policy or engine is replayed as the CLI does.

:func:`affected_answer` and :func:`findings_answer` are ``ask_affected`` and ``ask_findings`` handed the judge's
findings; the route tests compare both ways.

An answer on a judged snapshot is a function of the question and the batches judged, so
:class:`AnswerCache` keeps the latest few: queries that reach the same snapshot (dashboards of several
operators, a poll's worth of requests) share one computation, and a question asked while another
client computes it waits for that answer instead of computing it again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import duckdb

from kvtrail.audit.snapshot import drop_snapshot, make_snapshot, move_snapshot, store_tables, using_snapshot
from kvtrail.forensics import Answer, Exclusions, Finding, Window, ask_affected, ask_findings
from kvtrail.forensics.questions import WindowContext, window_context

T = TypeVar("T")
JUDGED_WAIT_S = 5.0  # how long a query waits for the judge to reach the acknowledged batches, else it replays
CACHED_ANSWERS = 64
KEPT_SNAPSHOTS = 2  # the latest judged snapshots kept attached for the questions still to come on them
SPARE_SNAPSHOTS = 2  # snapshots no longer kept, held to be moved to the next judged states


class AnswerCache:
    """The latest answers computed on judged snapshots, by (question, batches judged). Thread-safe; an
    answer being computed is waited for, a failed computation is not kept."""

    def __init__(self, size: int = CACHED_ANSWERS):
        self.size = size
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()
        self._done: OrderedDict[Hashable, Any] = OrderedDict()
        self._pending: dict[Hashable, threading.Event] = {}

    def get(self, key: Hashable, compute: Callable[[], T], wait_s: float = 60.0) -> T:
        while True:
            with self._lock:
                if key in self._done:
                    self.hits += 1
                    self._done.move_to_end(key)
                    return self._done[key]
                running = self._pending.get(key)
                if running is None:
                    self._pending[key] = mine = threading.Event()
                    self.misses += 1
                    break
            if not running.wait(wait_s):  # the other computation is stuck: compute it here
                return compute()
            # done: the next turn finds its answer, or (it failed) computes it or waits for whoever does
        try:
            value = compute()
            with self._lock:
                self._done[key] = value
                while len(self._done) > self.size:
                    self._done.popitem(last=False)
            return value
        finally:
            with self._lock:
                self._pending.pop(key, None)
            mine.set()


class _Snap:
    def __init__(self) -> None:
        self.name: str | None = None
        self.store = ""
        self.tables: frozenset[str] = frozenset()  # the store's tables its views show
        self.users = 0
        self.ready = threading.Event()
        self.failed = False


class SharedSnapshots:
    """Snapshots of the store as of the batches judged, shared by every answer computed on the same ones:
    one per judged state, kept while questions use them or while they are among the latest ``keep``.
    Making a snapshot's views costs tens of milliseconds, so up to ``spare`` of those no longer kept are
    moved to the next judged states instead (``move_snapshot``, about 2 ms) while the store holds the same
    tables; the rest are detached. Thread-safe."""

    def __init__(self, keep: int = KEPT_SNAPSHOTS, spare: int = SPARE_SNAPSHOTS):
        self.keep = keep
        self.spare = spare
        self.made = 0  # judged states given a snapshot (made, or moved from a spare one)
        self.moved = 0  # ... of them, by moving a spare one
        self._lock = threading.Lock()
        self._snaps: OrderedDict[Hashable, _Snap] = OrderedDict()
        self._spares: list[_Snap] = []  # no longer kept, no question on them: the next judged states'

    @contextmanager
    def use(self, cur: duckdb.DuckDBPyConnection, marks: dict[int, int]) -> Iterator[None]:
        """``cur`` on the store as of ``marks`` ({producer_id: batch_no}) while the block runs."""
        key = tuple(sorted(marks.items()))
        spare = None
        with self._lock:
            snap = self._snaps.get(key)
            mine = snap is None
            if snap is None:
                snap = self._snaps[key] = _Snap()
                spare = self._spares.pop() if self._spares else None
            snap.users += 1
        try:
            if mine:
                try:
                    self._provide(cur, snap, spare, [{"producer_id": p, "batch_no": n} for p, n in marks.items()])
                except BaseException:
                    snap.failed = True
                    raise
                finally:
                    snap.ready.set()
            else:
                snap.ready.wait()
            if snap.failed or snap.name is None:
                raise RuntimeError("the snapshot of the judged batches could not be made")
            with using_snapshot(cur, snap.name, snap.store):
                yield
        finally:
            with self._lock:
                snap.users -= 1
                if snap.failed and self._snaps.get(key) is snap:
                    del self._snaps[key]
                stale = [k for k in list(self._snaps)[: -self.keep] if self._snaps[k].users == 0]
                gone = [s for s in (self._snaps.pop(k) for k in stale) if s.name is not None and not s.failed]
                room = max(0, self.spare - len(self._spares))
                self._spares += gone[:room]
                gone = gone[room:]
            for old in gone:
                assert old.name is not None
                drop_snapshot(cur, old.name)

    def _provide(self, cur: duckdb.DuckDBPyConnection, snap: _Snap, spare: _Snap | None, heads: list[dict]) -> None:
        """Give ``snap`` its views as of ``heads``: ``spare``'s moved there while the store holds the tables it
        was made for, else made afresh (``spare`` then detached)."""
        if spare is not None and spare.name is not None:
            try:
                if store_tables(cur, spare.store) == spare.tables:
                    move_snapshot(cur, spare.name, heads)
                    snap.name, snap.store, snap.tables = spare.name, spare.store, spare.tables
                    self.made += 1
                    self.moved += 1
                    return
            except BaseException:
                drop_snapshot(cur, spare.name)
                raise
            drop_snapshot(cur, spare.name)
        store = cur.execute("SELECT current_database()").fetchone()
        assert store is not None
        snap.tables = store_tables(cur, store[0])  # read once: the views shown are exactly these
        snap.name, snap.store = make_snapshot(cur, heads, snap.tables)
        self.made += 1


@contextmanager
def judged_findings(cur: duckdb.DuckDBPyConnection, state: Any, w: Window) -> Iterator[list[Finding] | None]:
    """The window's findings from the live judge, with ``cur`` on the store as of the batches it judged;
    None (and ``cur`` left on the live store) when the judge cannot answer for this window."""
    got = state.judge.judged(dict(state.committer.heads), JUDGED_WAIT_S)
    if got is None or not got[0] or covering(w, judged_span(cur, got[0])) is None:
        yield None
        return
    marks, found = got
    with state.snapshots.use(cur, marks):
        yield [f for f in found if w.from_ns is None or f.last_ns >= w.from_ns]


def affected_answer(
    con: duckdb.DuckDBPyConnection,
    w: Window,
    found: list[Finding],
    exclusions: Exclusions,
    context: WindowContext | None = None,
) -> Answer:
    """``ask_affected``'s answer from the window's findings (and its context, when shared)."""
    return ask_affected(con, w, exclusions=exclusions, found=found, context=context)


def findings_answer(
    con: duckdb.DuckDBPyConnection,
    w: Window,
    found: list[Finding],
    codes: tuple[str, ...],
    exclusions: Exclusions,
    context: WindowContext | None = None,
) -> Answer:
    """``ask_findings``'s answer (replay engine, the judge's policy) from the window's findings."""
    return ask_findings(con, w, codes=codes, exclusions=exclusions, found=found, context=context)


def judged_span(cur: duckdb.DuckDBPyConnection, marks: dict[int, int]) -> tuple[int | None, int | None]:
    """The first and last wall clock of the batches ``marks`` ({producer_id: batch_no}) and those before
    them (what a snapshot as of ``marks`` holds), read from the live store without making the snapshot."""
    if not marks:
        return None, None
    pairs = ", ".join("(?, ?)" for _ in marks)
    rows = cur.execute(
        f"SELECT min(b.min_wall_ns), max(b.max_wall_ns) FROM batches b JOIN (VALUES {pairs}) "
        "h(producer_id, batch_no) ON b.producer_id = h.producer_id AND b.batch_no <= h.batch_no",
        [x for kv in marks.items() for x in kv],
    ).fetchall()
    row = rows[0]
    return row[0], row[1]


def covering(w: Window, span: tuple[int | None, int | None]) -> Window | None:
    """The unbounded window with ``w``'s filters when ``w`` covers ``span`` (every event of the snapshot
    lies in it, so it asks what the unbounded window asks), else None."""
    first, last = span
    if (
        first is None
        or last is None
        or (w.from_ns is not None and w.from_ns > first)
        or (w.to_ns is not None and w.to_ns < last)
    ):
        return None
    return Window(None, None, tenant=w.tenant, node=w.node)


def judged_or_replayed(
    cur: duckdb.DuckDBPyConnection,
    state: Any,
    w: Window,
    judged: Callable[[duckdb.DuckDBPyConnection, Window, list[Finding], WindowContext | None], T],
    replayed: Callable[[duckdb.DuckDBPyConnection], T],
    question: Hashable = None,
) -> T:
    """``judged(cur, window, findings, context)`` on the store as of what the judge holds when it can answer
    for ``w``, else ``replayed(cur)`` (the CLI's replay of the window) on the live store.

    A window covering every judged event asks what the unbounded window with its filters asks, so ``judged``
    is handed that window. ``question``: everything else its answer depends on, as a hashable key; then the
    answer on the same snapshot is taken from ``state.answers`` (whichever covering window another client
    asked with), and so is the snapshot's context (coverage gaps, notes, warnings' pieces), which every
    question there shares; a cached answer costs no snapshot at all. None computes both."""
    got = state.judge.judged(dict(state.committer.heads), JUDGED_WAIT_S)
    if got is None or not got[0]:
        return replayed(cur)
    marks, found = got
    key = tuple(sorted(marks.items()))
    u = covering(w, judged_span(cur, marks))
    if u is None:
        return replayed(cur)

    def answer() -> T:
        with state.snapshots.use(cur, marks):
            if question is None:
                return judged(cur, u, found, None)
            context = state.answers.get((("context", u), key), lambda: window_context(cur, u))
            return judged(cur, u, found, context)

    return answer() if question is None else state.answers.get((question, u, key), answer)
