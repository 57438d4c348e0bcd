"""Answers from what the live judge holds: ``affected`` and ``findings`` without replaying the window.

The judge's replay has seen every batch it judged, from the first, so for a window that starts at or
before the store's first event and ends at or after the last one it judged, its findings are the ones
a replay of the window would find (those ending before ``from`` left out, as ``replay_store`` does).
:func:`judged_findings` waits (bounded) until the judge has judged at least the batches acknowledged
when the query came, then points the cursor at the store *as of the batches judged*
(:func:`~kvtrail.service.reports.live_snapshot`), so the SQL half of the answer (responses, gaps,
notes, warnings, exclusions) reads the same events the findings came from: the answer is the CLI's
answer on the store at that point. Any other window, policy or engine is replayed as the CLI does.

:func:`affected_answer` and :func:`findings_answer` compose an answer from given findings with the
same steps as ``ask_affected`` and ``ask_findings``; the route tests compare both ways.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import duckdb

from kvtrail.errors import KvtrailError
from kvtrail.forensics import (
    CODES,
    Answer,
    Exclusions,
    Finding,
    Window,
    affected_with_exclusions,
    check_exclusions,
    coverage_gaps,
    excluded_mask,
    excluded_requests,
    findings_frame,
)
from kvtrail.forensics.symptoms import (
    empty_after_abort,
    empty_after_abort_note,
    incomplete_requests,
    integrity_warnings,
    window_ends,
    withhold_incomplete,
)
from kvtrail.forensics.window import check_window
from kvtrail.service.reports import live_snapshot

T = TypeVar("T")
JUDGED_WAIT_S = 5.0  # how long a query waits for the judge to reach the acknowledged batches, else it replays


@contextmanager
def judged_findings(cur: duckdb.DuckDBPyConnection, state: Any, w: Window) -> Iterator[list[Finding] | None]:
    """The window's findings from the live judge, with ``cur`` on the store as of the batches it judged;
    None (and ``cur`` left on the live store) when the judge cannot answer for this window."""
    got = state.judge.judged(dict(state.committer.heads), JUDGED_WAIT_S)
    if got is None or not got[0]:
        yield None
        return
    marks, found = got
    with live_snapshot(cur, [{"producer_id": p, "batch_no": n} for p, n in marks.items()]):
        row = cur.execute("SELECT min(min_wall_ns), max(max_wall_ns) FROM batches").fetchone()
        assert row is not None
        first, last = row
        covers = first is not None and (w.from_ns is None or w.from_ns <= first) and (
            w.to_ns is None or w.to_ns >= last)
        if not covers:
            yield None
            return
        yield [f for f in found if w.from_ns is None or f.last_ns >= w.from_ns]


def _notes(con: duckdb.DuckDBPyConnection, w: Window) -> tuple[str, ...]:
    note = empty_after_abort_note(empty_after_abort(con, w))
    return (note,) if note else ()


def affected_answer(con: duckdb.DuckDBPyConnection, w: Window, found: list[Finding],
                    exclusions: Exclusions) -> Answer:
    """``ask_affected``'s answer from the window's findings."""
    kept, dropped, _ = affected_with_exclusions(con, w, exclusions, found)
    return Answer(kept, dropped, coverage_gaps(con), _notes(con, w), integrity_warnings(con, w))


def findings_answer(con: duckdb.DuckDBPyConnection, w: Window, found: list[Finding], codes: tuple[str, ...],
                    exclusions: Exclusions) -> Answer:
    """``ask_findings``'s answer (replay engine, the judge's policy) from the window's findings."""
    bad = [c for c in codes if c not in CODES]
    if bad:
        raise KvtrailError(f"--code: unknown finding code {bad[0]!r}; known: {', '.join(CODES)}")
    check_exclusions(con, exclusions)
    check_window(con, w)
    ends = window_ends(con, w)
    incomplete = incomplete_requests(con, w, ends)
    found, withheld = withhold_incomplete(found, incomplete)
    df, excluded, gaps = findings_frame(found, w, codes), excluded_requests(con, exclusions), coverage_gaps(con)
    notes = _notes(con, w)
    warnings = integrity_warnings(con, w, ends=ends, incomplete=incomplete, withheld=len(withheld))
    hit = excluded_mask(excluded, exclusions)
    return Answer(df.filter(~hit), df.filter(hit), gaps, notes, warnings, found=tuple(found))


def judged_or_replayed(cur: duckdb.DuckDBPyConnection, state: Any, w: Window,
                       judged: Callable[[duckdb.DuckDBPyConnection, list[Finding]], T],
                       replayed: Callable[[duckdb.DuckDBPyConnection], T]) -> T:
    """``judged(cur, findings)`` on the store as of what the judge holds when it can answer for ``w``,
    else ``replayed(cur)`` (the CLI's replay of the window) on the live store."""
    with judged_findings(cur, state, w) as found:
        if found is not None:
            return judged(cur, found)
    return replayed(cur)
