"""``kvtrail audit verify``: recompute every producer's batch chain from the stored rows.

For each producer, batch numbers must run 0..n-1 without a hole, each batch's ``prev_digest`` must be
the previous batch's digest, and each batch's digest must match its rows recomputed in canonical
form. Pruned batches keep their header (so the links still check) and must be listed by a prune
record whose own chain verifies. The report also states sequence coverage: events missing from a
producer's numbering, and how many of them ``recorder_gap`` events account for.

The chain cannot show that a producer's newest batches were deleted, or that the whole chain was
rewritten: :func:`kvtrail.audit.heads.compare_heads` checks the store against heads saved outside it earlier
(``kvtrail audit head --json``, or the heads a disclosure report recorded).

Nor can numbering show a lost *tail*: events a killed process still held in memory. For that,
:func:`unclean_ends` names each producer instance that ended without its ``recorder_closed`` event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import numpy as np

from kvtrail.audit import chain
from kvtrail.audit.layout import EVENT_COLUMNS, has_kind_tables
from kvtrail.audit.retention import prune_digest
from kvtrail.audit.store import EVENTS_SCHEMA, RUN_COLUMNS, RUNS_SCHEMA, arrow_query, connect_readonly
from kvtrail.timeutil import format_utc

# A batch committed later than this after its newest event was not committed by a live recorder (an import, a
# backfill, a clock far off): its delay says nothing of what a batch in flight can lose.
MAX_COMMIT_DELAY_NS = 3600 * 10**9


@dataclass(frozen=True)
class Problem:
    producer_id: int | None
    node: str | None
    batch_no: int | None
    what: str

    def __str__(self) -> str:
        if self.producer_id is None:
            where = "store"
        else:
            where = f"producer {self.producer_id} ({self.node}) batch {self.batch_no}"
        return f"{where}: {self.what}"


@dataclass(frozen=True)
class Coverage:
    producer_id: int
    node: str
    first_seq: int
    last_seq: int
    stored_events: int
    pruned_events: int
    missing_events: int
    explained_by_gaps: int

    @property
    def unexplained(self) -> int:
        return max(0, self.missing_events - self.explained_by_gaps)


@dataclass(frozen=True)
class UncleanEnd:
    """A producer instance that ended without ``recorder_closed``: events after ``last_seq`` may be lost.

    ``bound_ns``: how long its events could wait in memory for the next drain (``flush_interval_ns`` of
    its ``recorder_started``); None when unknown. A drained batch is lost too while it is in flight (sent,
    queued behind other commits, committing): ``commit_delay_ns`` is the slowest the store saw of this
    producer, from a batch's newest event to its commit (``committed_ns - max_wall_ns``). What may be lost
    lies within ``loss_bound_ns`` = flush interval + that delay after ``last_wall_ns`` (a commit slower
    than every one before it, in flight when the store died, can lose more); ``ended_by_ns``: when it was
    seen to have ended (the later instance's first event, or the store's reopening), bounds the gap too.
    """

    producer_id: int
    node: str
    instance: str
    last_seq: int
    last_wall_ns: int
    bound_ns: int | None
    reason: str
    cluster: str = ""
    ended_by_ns: int | None = None
    commit_delay_ns: int = 0

    @property
    def loss_bound_ns(self) -> int | None:
        """How long after ``last_wall_ns`` a lost event can have been recorded: flush interval + commit delay."""
        return None if self.bound_ns is None else self.bound_ns + self.commit_delay_ns

    @property
    def gap_end_ns(self) -> int | None:
        """The latest time a lost event can have: the bound or the end's evidence, whichever comes first."""
        bound = self.loss_bound_ns
        ends = [t for t in (None if bound is None else self.last_wall_ns + bound, self.ended_by_ns) if t is not None]
        return min(ends) if ends else None

    def __str__(self) -> str:
        bound = self.loss_bound_ns
        lost = (
            "events up to an unknown time after it may be lost"
            if bound is None or self.bound_ns is None
            else f"events up to {bound / 1e9:g} s after it may be lost (flush interval {self.bound_ns / 1e9:g} s "
            f"+ slowest commit {self.commit_delay_ns / 1e9:g} s)"
        )
        return (
            f"{self.node} producer {self.producer_id} (instance {self.instance}): unclean end after seq "
            f"{self.last_seq} at {format_utc(self.last_wall_ns)}: {lost} ({self.reason})"
        )


@dataclass
class VerifyReport:
    batches_checked: int = 0
    batches_pruned: int = 0
    events_checked: int = 0
    signatures_checked: int = 0
    problems: list[Problem] = field(default_factory=list)
    coverage: list[Coverage] = field(default_factory=list)
    # Coverage gaps at the end of a producer's numbering; not a chain failure (``ok`` ignores them).
    unclean_ends: list[UncleanEnd] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def first_problem(self) -> Problem | None:
        return self.problems[0] if self.problems else None

    def to_dict(self, *, head_problems: list | None = None, heads_checked: int = 0) -> dict:
        """The document ``kvtrail audit verify --json`` prints (``head_problems``: from --expect-heads)."""
        extra = [str(p) for p in head_problems or []]
        return {
            "ok": self.ok and not extra,
            "batches_checked": self.batches_checked,
            "batches_pruned": self.batches_pruned,
            "events_checked": self.events_checked,
            "signatures_checked": self.signatures_checked,
            "heads_checked": heads_checked,
            "problems": [str(p) for p in self.problems] + extra,
            "coverage": [dict(c.__dict__, unexplained=c.unexplained) for c in self.coverage],
            "unclean_ends": [dict(u.__dict__, gap_end_ns=u.gap_end_ns) for u in self.unclean_ends],
        }


def verify_store(
    db: str | Path | duckdb.DuckDBPyConnection, *, checker: chain.SignatureChecker | None = None, progress=None
) -> VerifyReport:
    """Verify a store (path or open connection). ``progress(n)`` is called after each batch checked."""
    con = connect_readonly(db) if isinstance(db, (str, Path)) else db
    report = VerifyReport()
    producers = con.execute("SELECT producer_id, node FROM producers ORDER BY producer_id").fetchall()
    for pid, node in producers:
        _verify_producer(con, pid, node, report, checker, progress)
    stray = con.execute(
        "SELECT e.producer_id, e.batch_no, count(*) FROM events e ANTI JOIN batches b USING (producer_id, batch_no) "
        "GROUP BY ALL ORDER BY ALL LIMIT 5"
    ).fetchall()
    stray += con.execute(
        "SELECT r.producer_id, r.batch_no, count(*) FROM page_runs r ANTI JOIN batches b USING (producer_id, batch_no) "
        "GROUP BY ALL ORDER BY ALL LIMIT 5"
    ).fetchall()
    for pid, batch_no, n in stray:
        report.problems.append(Problem(pid, None, batch_no, f"{n} rows belong to no committed batch (inserted?)"))
    _verify_prunes(con, report)
    report.unclean_ends = unclean_ends(con, resting=at_rest(con))  # read read-only: nothing will commit the ends
    if isinstance(db, (str, Path)):
        con.close()
    return report


def _verify_producer(con, pid: int, node: str, report: VerifyReport, checker, progress) -> None:
    batches = con.execute(
        "SELECT batch_no, first_seq, last_seq, num_events, num_runs, prev_digest, digest, signature, pruned_by "
        "FROM batches WHERE producer_id = ? ORDER BY batch_no",
        [pid],
    ).fetchall()
    events = arrow_query(con, f"SELECT {EVENT_COLUMNS} FROM events WHERE producer_id = ? ORDER BY batch_no, seq", [pid])
    runs = arrow_query(
        con, f"SELECT {RUN_COLUMNS} FROM page_runs WHERE producer_id = ? ORDER BY batch_no, seq, list, pos", [pid]
    )
    ev_batch = events.column("batch_no").to_numpy()
    run_batch = runs.column("batch_no").to_numpy()
    prev_digest, prev_last_seq, broken = chain.GENESIS, None, False
    stored = pruned_events = 0
    for expect_no, (batch_no, first_seq, last_seq, n_ev, n_runs, prev, digest, sig, pruned_by) in enumerate(batches):
        prev, digest = bytes(prev), bytes(digest)

        def problem(what: str, _no=batch_no) -> None:
            report.problems.append(Problem(pid, node, _no, what))

        if batch_no != expect_no and not broken:
            problem(f"missing link: batch {expect_no} is absent (deleted?)")
            broken = True
        elif prev != prev_digest and not broken:
            problem("broken link: prev_digest does not equal the previous batch's digest")
            broken = True
        if prev_last_seq is not None and first_seq <= prev_last_seq:
            problem(f"sequence range overlaps the previous batch (first_seq {first_seq} <= {prev_last_seq})")
        lo, hi = np.searchsorted(ev_batch, batch_no, "left"), np.searchsorted(ev_batch, batch_no, "right")
        rlo, rhi = np.searchsorted(run_batch, batch_no, "left"), np.searchsorted(run_batch, batch_no, "right")
        if pruned_by is not None:
            report.batches_pruned += 1
            pruned_events += n_ev
            if hi > lo or rhi > rlo:
                problem("marked pruned but still has rows")
        else:
            header = (pid, batch_no, int(first_seq), int(last_seq), n_ev, n_runs)
            ev_slice, run_slice = events.slice(lo, hi - lo), runs.slice(rlo, rhi - rlo)
            recomputed = chain.batch_digest(prev, header, ev_slice, EVENTS_SCHEMA, run_slice, RUNS_SCHEMA)
            if recomputed != digest:
                detail = "rows edited, reordered or replaced"
                if hi - lo != n_ev:
                    detail = f"{n_ev} events committed, {hi - lo} present (deleted or inserted rows)"
                elif rhi - rlo != n_runs:
                    detail = f"{n_runs} page runs committed, {rhi - rlo} present"
                problem(f"content does not match its digest: {detail}")
            stored += hi - lo
            report.events_checked += int(hi - lo)
        if checker is not None:
            report.signatures_checked += 1
            if not checker.check(digest, None if sig is None else bytes(sig)):
                problem("signature missing or invalid for the given public key")
        report.batches_checked += 1
        prev_digest, prev_last_seq = digest, last_seq
        if progress:
            progress(1)
    if batches:
        first, last = int(batches[0][1]), int(batches[-1][2])
        gaps = con.execute(
            "SELECT coalesce(sum(dropped_events), 0) FROM events WHERE producer_id = ? AND kind = 'recorder_gap'", [pid]
        ).fetchone()[0]
        span = last - first + 1
        report.coverage.append(
            Coverage(
                pid, node, first, last, int(stored), int(pruned_events), int(span - stored - pruned_events), int(gaps)
            )
        )


def _verify_prunes(con, report: VerifyReport) -> None:
    prunes = con.execute(
        "SELECT prune_id, wall_ns, before_ns, num_batches, num_events, num_held_batches, note, "
        "prev_digest, digest FROM prunes ORDER BY prune_id"
    ).fetchall()
    prev = chain.GENESIS
    for prune_id, wall_ns, before_ns, nb, ne, nh, note, prev_d, digest in prunes:
        listed = con.execute(
            "SELECT producer_id, batch_no FROM prune_batches WHERE prune_id = ? ORDER BY producer_id, batch_no",
            [prune_id],
        ).fetchall()
        expect = prune_digest(prev, prune_id, wall_ns, before_ns, nb, ne, nh, note, listed)
        if bytes(prev_d) != prev or bytes(digest) != expect:
            report.problems.append(Problem(None, None, None, f"prune record {prune_id} does not match its digest"))
        prev = bytes(digest)
    orphans = con.execute(
        "SELECT b.producer_id, b.batch_no, b.pruned_by FROM batches b LEFT JOIN prune_batches pb "
        "ON pb.producer_id = b.producer_id AND pb.batch_no = b.batch_no AND pb.prune_id = b.pruned_by "
        "LEFT JOIN prunes p ON p.prune_id = b.pruned_by "
        "WHERE b.pruned_by IS NOT NULL AND (pb.prune_id IS NULL OR b.max_wall_ns >= p.before_ns) LIMIT 5"
    ).fetchall()
    for pid, batch_no, prune_id in orphans:
        report.problems.append(
            Problem(pid, None, batch_no, f"marked pruned by {prune_id} but no prune record covers it")
        )


# ---- producer ends -----------------------------------------------------------------------------

OPENS_TABLE = "store_opens"  # one row per writable open of the store: (open_no, opened_ns, kvtrail_version)


def _has(con: duckdb.DuckDBPyConnection, table: str, column: str | None = None) -> bool:
    sql = (
        "SELECT count(*) FROM duckdb_columns() WHERE database_name = current_database() "
        "AND schema_name = 'main' AND table_name = ? AND (? IS NULL OR column_name = ?)"
    )
    row = con.execute(sql, [table, column, column]).fetchone()
    return bool(row and row[0])


def at_rest(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether ``con`` reads the store read-only: then no process holds it for writing (DuckDB refuses a
    read-only open of a file another process has open read-write), so its owner is not running."""
    row = con.execute("SELECT readonly FROM duckdb_databases() WHERE database_name = current_database()").fetchone()
    return bool(row and row[0])


def unclean_ends(
    con: duckdb.DuckDBPyConnection, *, kinds: bool | None = None, resting: bool = False
) -> list[UncleanEnd]:
    """Producer instances that ended without ``recorder_closed``, in producer order.

    Judged are instances that announce their lifecycle (a ``recorder_started`` event, or a first batch
    pruned so we cannot tell) and whose last batch is still stored. One without ``recorder_closed``
    has ended uncleanly when a later instance of its (cluster, node) started after its last stored
    event, or when the store was opened for writing again after its last commit (its owner restarted:
    the ``store_opens`` table, where the store has one), or when the caller knows the store is at rest
    (``resting``, e.g. :func:`at_rest`: a copy of a crashed store read read-only), since nothing can commit its
    ``recorder_closed`` any more: its last stored batch is the last word the store has of it. Otherwise
    (a store its owner holds) it is open: still running, or stopped and not yet known, and not
    reported. Producers that record no lifecycle events (older stores, other engines' files, the
    simulator) are not judged. ``kinds``: whether the store has its kind tables
    (``layout.has_kind_tables``; None: look).
    """
    if has_kind_tables(con) if kinds is None else kinds:  # the two kinds' own tables, not the events view
        life = (
            "SELECT producer_id, bool_or(kind = 'recorder_closed') AS closed, "
            "bool_or(kind = 'recorder_started') AS started, "
            "max(flush_interval_ns) FILTER (kind = 'recorder_started') AS bound_ns "
            "FROM (SELECT producer_id, 'recorder_started' AS kind, flush_interval_ns FROM events_recorder_started "
            "UNION ALL SELECT producer_id, 'recorder_closed', NULL::BIGINT FROM events_recorder_closed) "
            "GROUP BY producer_id"
        )
    elif _has(con, "events", "flush_interval_ns"):
        life = (
            "SELECT producer_id, bool_or(kind = 'recorder_closed') AS closed, "
            "bool_or(kind = 'recorder_started') AS started, "
            "max(flush_interval_ns) FILTER (kind = 'recorder_started') AS bound_ns "
            "FROM events WHERE kind IN ('recorder_started', 'recorder_closed') GROUP BY producer_id"
        )
    else:  # a store from before the lifecycle kinds: nothing to judge but pruned beginnings
        life = "SELECT NULL::BIGINT AS producer_id, false AS closed, false AS started, NULL::BIGINT AS bound_ns"
    rows = con.execute(f"""
        WITH spans AS (
            SELECT producer_id, min(min_wall_ns) AS first_wall, max(max_wall_ns) AS last_wall,
                   max(last_seq) AS last_seq, max(committed_ns) AS last_commit,
                   greatest(max(committed_ns - max_wall_ns)
                            FILTER (committed_ns - max_wall_ns <= {MAX_COMMIT_DELAY_NS}), 0) AS commit_delay,
                   arg_max(pruned_by IS NOT NULL, batch_no) AS last_pruned,
                   arg_min(pruned_by IS NOT NULL, batch_no) AS first_pruned
            FROM batches GROUP BY producer_id),
        life AS ({life})
        SELECT p.producer_id, p.cluster, p.node, p.instance, s.first_wall, s.last_wall, s.last_seq, s.last_commit,
               s.commit_delay, s.last_pruned, s.first_pruned, coalesce(l.closed, false), coalesce(l.started, false),
               l.bound_ns
        FROM producers p JOIN spans s USING (producer_id) LEFT JOIN life l USING (producer_id)
        ORDER BY p.producer_id""").fetchall()
    opens: list[int] = []
    if _has(con, OPENS_TABLE):
        opens = [int(t) for (t,) in con.execute(f"SELECT opened_ns FROM {OPENS_TABLE} ORDER BY opened_ns").fetchall()]
    starts: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for _pid, cluster, node, instance, first_wall, *_ in rows:
        starts.setdefault((cluster, node), []).append((int(first_wall), instance))
    ends = []
    for (
        pid,
        cluster,
        node,
        instance,
        _first,
        last_wall,
        last_seq,
        last_commit,
        commit_delay,
        last_pruned,
        first_pruned,
        closed,
        started,
        bound,
    ) in rows:
        if closed or last_pruned or not (started or first_pruned):
            continue
        last_wall = int(last_wall)
        later = sorted((t, inst) for t, inst in starts[(cluster, node)] if t > last_wall and inst != instance)
        # Opens and commits are both on the store owner's clock (events may be older than both: ingest).
        reopened = [t for t in opens if t > last_commit]
        if later:
            ended_by, reason = later[0][0], f"a later instance {later[0][1]} started at {format_utc(later[0][0])}"
        elif reopened:
            ended_by, reason = reopened[0], f"the store's owner restarted at {format_utc(reopened[0])}"
        elif resting:
            ended_by = None  # the owner stopped at some time after the last commit (not recorded)
            reason = (
                f"no recorder_closed and no later instance, and the store is at rest (read read-only) since "
                f"its last commit at {format_utc(int(last_commit))}"
            )
        else:
            continue
        ends.append(
            UncleanEnd(
                int(pid),
                node,
                instance,
                int(last_seq),
                last_wall,
                None if bound is None else int(bound),
                reason,
                cluster,
                ended_by,
                int(commit_delay),
            )
        )
    return ends
