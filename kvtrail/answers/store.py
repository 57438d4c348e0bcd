"""``StoreSource``: what the dashboard reads from a store file, read-only, one short connection per page load.

Every number comes from the forensics API (``kvtrail.forensics``): the same building blocks the ``ask_*``
questions use, so a view shows what the CLI would print for the same window and filters. What is heavy is
the window's findings: they are read from persisted findings (``forensics findings --save`` or the live
judge) when a run covers the window, and replayed otherwise. Counters over the window's events (recorder
drops, transfers, findings per minute) come from the per-minute aggregates those runs keep
(``kvtrail.forensics.results.aggregates``) where they cover it, and from the events for the rest. Every answer
is computed once per (window, store state) and kept in a small memo; the store state is what the OS says
of its two files (any commit, checkpoint or saved run changes them), so a reload of an unchanged store
opens no connection at all.

A store that is missing, held by a writer, or of another format raises :class:`SourceError` with a
``kind`` the app turns into an error page.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import polars as pl

from kvtrail import forensics as fx
from kvtrail.answers import fleet, pages, persisted, transfers
from kvtrail.answers.text import coverage_lines
from kvtrail.audit.store import connect_readonly
from kvtrail.audit.storefile import wal_path
from kvtrail.errors import KvtrailError, StoreError
from kvtrail.forensics.analysis import (
    exposure_links,
    exposure_matrix,
    node_capacity,
    requests_table,
    threshold_sentence,
)
from kvtrail.forensics.options import ReportOptions
from kvtrail.forensics.questions import (
    affected_with_exclusions,
    coverage_gaps,
    exploitation_for,
    findings_frame,
    thresholds_of,
)
from kvtrail.forensics.results import window_counts
from kvtrail.forensics.symptoms import integrity_warnings

PERSISTED = "persisted findings"  # how found() names findings read from a saved run
MEMO_WINDOWS = 16  # heavy answers kept per (question, window, store state); a few windows of one session


class SourceError(KvtrailError):
    """The store cannot be read: ``kind`` is missing, locked, newer or invalid (the error page's wording)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def classify(exc: StoreError) -> SourceError:
    text = str(exc)
    if "not found" in text:
        return SourceError("missing", text)
    if "in use by another process" in text:
        return SourceError("locked", text)
    if "has format" in text:
        return SourceError("newer", text)
    return SourceError("invalid", text)


@dataclass(frozen=True)
class Thresholds:
    """The threshold view's table and its sentence."""

    table: pl.DataFrame
    sentence: str


class StoreSource:
    """A store file opened read-only per call (a writer in another process can take turns with it)."""

    role = "store"

    def __init__(self, db: str | Path):
        self.db = str(db)
        self.label = f"store {Path(db).name}"
        self._memo: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()
        with self.connect():
            pass

    @contextmanager
    def connect(self) -> Iterator[duckdb.DuckDBPyConnection]:
        try:
            con = connect_readonly(self.db)
        except StoreError as exc:
            raise classify(exc) from None
        try:
            yield con
        finally:
            con.close()

    # Every answer is memoised per (question, window, store state): a reload costs a stat of two files.

    def bounds(self) -> tuple[int, int] | None:
        """First and last event time in the store (ns), None when it holds none."""

        def compute(con: duckdb.DuckDBPyConnection) -> tuple[int, int] | None:
            row = con.execute("SELECT min(min_wall_ns), max(max_wall_ns) FROM batches").fetchall()[0]
            return None if row[0] is None else (int(row[0]), int(row[1]))

        return self._memoised("bounds", fx.Window(), compute)

    def events_in(self, w: fx.Window) -> int:
        """Events of batches overlapping the window (an upper bound; 0 means an empty window)."""
        span = fx.Window(w.from_ns, w.to_ns)
        return self._memoised(
            "events_in",
            span,
            lambda con: int(
                con.execute(
                    "SELECT coalesce(sum(num_events), 0) FROM batches WHERE max_wall_ns >= ? AND min_wall_ns <= ?",
                    [w.from_ns or 0, w.to_ns or 2**63 - 1],
                ).fetchall()[0][0]
            ),
        )

    def choices(self) -> tuple[list[str], list[str]]:
        """Every node and tenant the store knows (the filter's choices)."""

        def compute(con: duckdb.DuckDBPyConnection) -> tuple[list[str], list[str]]:
            nodes = [r[0] for r in con.execute("SELECT DISTINCT node FROM producers ORDER BY 1").fetchall()]
            tenants = [
                r[0]
                for r in con.execute(
                    "SELECT DISTINCT tenant_id FROM events_v WHERE kind = "
                    "'request_received' AND tenant_id IS NOT NULL ORDER BY 1"
                ).fetchall()
            ]
            return nodes, tenants

        return self._memoised("choices", fx.Window(), compute)

    def fleet(self, w: fx.Window) -> pl.DataFrame:
        """Every node configuration in the window with its producer's aggregates (``dashboards.fleet``)."""
        counts = self.counts(w)
        return self._memoised("fleet", w, lambda con: fleet.fleet_table(con, w, counts))

    def counts(self, w: fx.Window) -> window_counts.WindowCounts:
        """The window's counters per producer and persisted findings per minute: the aggregates where they
        cover it, the events elsewhere (tenant and node filters not applied)."""
        span = fx.Window(w.from_ns, w.to_ns)
        return self._memoised("counts", span, lambda con: window_counts.window_counts(con, w.from_ns, w.to_ns))

    def _state(self) -> tuple:
        """The store's files as the OS sees them: any commit, checkpoint or saved run changes one of them,
        so a memo hit needs no connection at all."""
        out: list[tuple[int, int, int] | None] = []
        for path in (Path(self.db), wal_path(self.db)):
            try:
                st = path.stat()
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except FileNotFoundError:
                out.append(None)
        return tuple(out)

    def _memoised(self, name: str, w: fx.Window, compute: Callable[[duckdb.DuckDBPyConnection], Any]) -> Any:
        key = (name, w, self._state())
        with self._lock:
            if key in self._memo:
                self._memo.move_to_end(key)
                return self._memo[key]
        with self.connect() as con:
            value = compute(con)
        with self._lock:
            self._memo[key] = value
            while len(self._memo) > MEMO_WINDOWS * 8:
                self._memo.popitem(last=False)
        return value

    def found(self, w: fx.Window) -> tuple[list[fx.Finding], str]:
        """Every finding of the window (tenant/node filters not applied) and where they came from."""
        span = fx.Window(w.from_ns, w.to_ns)

        def compute(con: duckdb.DuckDBPyConnection) -> tuple[list[fx.Finding], str]:
            fx.check_window(con, w)
            run = persisted.covering_run(con, w.from_ns, w.to_ns)
            if run is not None:
                return persisted.persisted_findings(con, w.from_ns, w.to_ns), f"{PERSISTED} (run {run})"
            return list(fx.ask_findings(con, span).found), "replay of the window"

        return self._memoised("found", span, compute)

    def rendering(self) -> StoreSource:
        """This source for one render of a view: itself (its answers are memoised by the store's state)."""
        return self

    def coverage(self, w: fx.Window) -> list[str]:
        """What every answer over the window says of the record it could not see (coverage gaps, integrity
        and coverage warnings), a line each, as the CLI prints them."""
        span = fx.Window(w.from_ns, w.to_ns)

        def compute(con: duckdb.DuckDBPyConnection) -> list[str]:
            fx.check_window(con, span)
            return coverage_lines(coverage_gaps(con), integrity_warnings(con, span))

        return self._memoised("coverage", span, compute)

    def findings(self, w: fx.Window) -> pl.DataFrame:
        found = self.found(w)[0]
        return self._memoised("findings", w, lambda con: findings_frame(found, w))

    def affected(self, w: fx.Window) -> pl.DataFrame:
        return self._affected_parts(w)[0]

    def _affected_parts(self, w: fx.Window) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
        """(kept, dropped, excluded) with no exclusions: the Affected view's rows and, for the whole span,
        the exploitation assessment's pieces (one computation when no filter is set)."""
        found = self.found(w)[0]
        return self._memoised("affected", w, lambda con: affected_with_exclusions(con, w, fx.Exclusions(), found))

    def exposure(self, w: fx.Window) -> pl.DataFrame:
        kept = set(self.affected(w)["request_id"])
        found = self.found(w)[0]

        def compute(con: duckdb.DuckDBPyConnection) -> pl.DataFrame:
            frame = findings_frame(found, w, tuple(sorted(fx.AFFECTED_CODES)))
            return exposure_matrix(exposure_links(frame, kept))

        return self._memoised("exposure", w, compute)

    def _requests(self, w: fx.Window, also: list[str]) -> pl.DataFrame:
        """The window's requests plus ``also`` (shared by the threshold and exploitation analyses)."""
        key = f"requests:{hash(tuple(sorted(also)))}"
        return self._memoised(
            key, fx.Window(w.from_ns, w.to_ns), lambda con: requests_table(con, w.from_ns, w.to_ns, also)
        )

    def thresholds(self, w: fx.Window) -> Thresholds:
        kept = self.affected(w)
        every = self._requests(w, kept["request_id"].to_list())

        def compute(con: duckdb.DuckDBPyConnection) -> Thresholds:
            table, summary = thresholds_of(node_capacity(con, w.from_ns, w.to_ns), every, kept, w)
            return Thresholds(table, threshold_sentence(summary))

        return self._memoised("thresholds", w, compute)

    def exploitation(self, w: fx.Window) -> pl.DataFrame:
        if w.from_ns is None or w.to_ns is None:
            raise KvtrailError("window: the exploitation assessment needs a bounded window")
        o = ReportOptions(w.from_ns, w.to_ns)
        span = fx.Window(w.from_ns, w.to_ns)
        assert o.exclusions == fx.Exclusions(), "the assessment's default exclusions are the Affected view's"
        kept, dropped, excluded = self._affected_parts(span)

        def compute(con: duckdb.DuckDBPyConnection) -> pl.DataFrame:
            requests = self._requests(span, kept["request_id"].to_list())
            pieces = (kept, dropped, excluded, node_capacity(con, o.from_ns, o.to_ns), requests)
            df, _ = exploitation_for(con, o, w, pieces)
            return df.filter(pl.col("tenant_id") == w.tenant) if w.tenant else df

        return self._memoised("exploitation", w, compute)

    def transfers(self, w: fx.Window) -> pl.DataFrame:
        found = self.found(w)[0]
        return self._memoised("transfers", w, lambda con: transfers.mismatches(con, found, w))

    def request(self, request_id: str, w: fx.Window, tenant: str | None = None) -> pages.RequestDetail:
        """One request's page ownership timeline, tokens and digests, TTFT (``tenant``'s request of that id,
        when requests of two tenants share it)."""
        found = [f for f in self.found(w)[0] if f.request_id == request_id and tenant in (None, f.tenant_id)]
        return self._memoised(
            f"request:{tenant}:{request_id}", w, lambda con: pages.request_detail(con, request_id, found, tenant)
        )
