"""The questions an incident responder asks, answered from the store: one function per question.

Each ``ask_*`` function takes a store (its path, opened read-only, or an open DuckDB connection), a
:class:`Window` and options, and returns an :class:`Answer`: the rows (a Polars DataFrame), the rows
exclusions left out, the coverage gaps of the store and notes in words. The CLI only parses flags,
calls one of them and formats; the HTTP API, the dashboard and the metrics call the same functions.

Coverage gaps are events a producer numbered but the store does not hold (and that no
``recorder_gap`` event accounts for): an answer over incomplete data must say so.

The building blocks below them (``findings_of``, ``findings_frame``, ``affected_responses``,
``affected_with_exclusions``) answer one step each, for callers that already hold findings.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import polars as pl

from kvtrail.audit.layout import has_kind_tables
from kvtrail.audit.store import connect_readonly
from kvtrail.audit.verify import UncleanEnd
from kvtrail.errors import KvtrailError
from kvtrail.forensics.analysis import (
    exploitation_assessment,
    exposure_links,
    exposure_matrix,
    long_prompt_threshold,
    node_capacity,
    requests_table,
    threshold_analysis,
    threshold_sentence,
    thresholds_table,
)
from kvtrail.forensics.analysis.exclusions import (
    Exclusions,
    check_exclusions,
    excluded_mask,
    excluded_requests,
    split_excluded,
)
from kvtrail.forensics.engine_signals import SignalPolicy, engine_signals, signal_notes
from kvtrail.forensics.findings import AFFECTED_CODES, CODES, NEVER_WRITTEN, Finding, findings_table
from kvtrail.forensics.options import ReportOptions
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.replay.engine import replay_store
from kvtrail.forensics.responses import response_of, responses_by_request
from kvtrail.forensics.sql.engine import sql_findings
from kvtrail.forensics.symptoms import (
    empty_after_abort,
    empty_after_abort_note,
    gap_rows,
    incomplete_requests,
    integrity_warnings,
    reported_losses,
    shared_transfer_ids,
    unverified_landings,
    unverified_landings_note,
    window_ends,
    withhold_incomplete,
)
from kvtrail.forensics.window import Window, check_window


def coverage_gaps(con: duckdb.DuckDBPyConnection, w: Window = Window(), *, kinds: bool | None = None) -> pl.DataFrame:
    """Per producer: sequence numbers missing from the store that no recorder_gap event explains.

    With a window's ``from_ns``/``to_ns``: only the batches whose events overlap it count (the missing
    numbers between them, and the recorder_gap events they hold); without one, the whole store.
    ``kinds``: whether the store has its kind tables (``layout.has_kind_tables``; None: look)."""
    sel, gaps, params = gap_rows(con, w, kinds)
    rows = con.execute(
        f"""
        WITH {sel}
        SELECT p.node, p.instance, b.first_seq, b.last_seq, b.num_events, b.pruned,
               coalesce(g.dropped, 0) AS reported
        FROM (SELECT producer_id, min(first_seq) AS first_seq, max(last_seq) AS last_seq,
                     sum(num_events) AS num_events, sum(num_events) FILTER (pruned_by IS NOT NULL) AS pruned
              FROM sel GROUP BY producer_id) b
        JOIN producers p USING (producer_id)
        LEFT JOIN (SELECT producer_id, sum(dropped_events) AS dropped FROM {gaps} GROUP BY producer_id) g
            USING (producer_id)""",
        params,
    ).fetchall()
    out = []
    for node, instance, first, last, stored, _pruned, reported in rows:
        missing = int(last - first + 1 - stored)
        if missing > reported:
            out.append(
                {
                    "node": node,
                    "instance": instance,
                    "missing_events": missing,
                    "reported_by_producer": int(reported),
                    "unexplained": missing - int(reported),
                }
            )
    return pl.DataFrame(
        out,
        schema={
            "node": pl.Utf8,
            "instance": pl.Utf8,
            "missing_events": pl.Int64,
            "reported_by_producer": pl.Int64,
            "unexplained": pl.Int64,
        },
    )


def findings_of(
    con: duckdb.DuckDBPyConnection,
    w: Window = Window(),
    *,
    engine: str = "replay",
    policy: ForensicsPolicy = ForensicsPolicy(),
    codes=None,
) -> list[Finding]:
    """Every finding of the window's events (tenant and node filters not applied), from either engine;
    ``codes`` limits the work to what a question needs."""
    check_window(con, w)
    if engine == "replay":
        return replay_store(con, w.from_ns, w.to_ns, policy, codes=codes)
    if engine == "sql":
        return sql_findings(con, w.from_ns, w.to_ns, policy, codes=codes)
    raise ValueError(f"engine: {engine!r} is not one of replay, sql")


def findings_frame(found: list[Finding], w: Window = Window(), codes: tuple[str, ...] = ()) -> pl.DataFrame:
    """Findings as a DataFrame, keeping ``codes`` (all when empty) and the window's tenant/node filters."""
    found = [
        f
        for f in found
        if (not codes or f.code in codes)
        and (w.tenant is None or f.tenant_id == w.tenant or w.tenant in f.victim_tenant_ids)
        and (w.node is None or f.node == w.node)
    ]
    return pl.DataFrame(findings_table(found))


def findings(
    con: duckdb.DuckDBPyConnection,
    w: Window = Window(),
    codes: tuple[str, ...] = (),
    *,
    engine: str = "replay",
    policy: ForensicsPolicy = ForensicsPolicy(),
) -> pl.DataFrame:
    """Every finding in the window (optionally only ``codes``), with evidence event ids."""
    return findings_frame(findings_of(con, w, engine=engine, policy=policy), w, codes)


def affected_responses(
    con: duckdb.DuckDBPyConnection, w: Window = Window(), found: list[Finding] | None = None
) -> pl.DataFrame:
    """Responses whose request read data it did not own (F1, F5): who, what the client got, whose data.

    ``codes``, ``victim_tenants`` and ``victim_requests`` are lists. A late writer (F7) is a source,
    not a recipient: it is here only if it read foreign data itself.
    ``found``: the window's findings when the caller already has them (they are not replayed again).
    """
    if found is None:
        found = findings_of(con, w, codes=AFFECTED_CODES)
    else:
        check_window(con, w)
    found = [f for f in found if f.code in AFFECTED_CODES]
    by_request: dict[tuple[str, str | None], dict] = {}  # a request is its (id, tenant), not its id text
    for f in found:
        assert f.request_id is not None, f"{f.code} finding without a recipient request: {f.detail}"
        row = by_request.setdefault(
            (f.request_id, f.tenant_id),
            {
                "request_id": f.request_id,
                "tenant_id": f.tenant_id,
                "codes": set(),
                "foreign_pages": set(),
                "victim_request_ids": set(),
                "victim_tenant_ids": set(),
                "first_ns": f.first_ns,
                "last_ns": f.last_ns,
            },
        )
        row["codes"].add(f.code)
        row["foreign_pages"].update((f.node, p) for p in f.pages)
        row["victim_request_ids"].update(v for v in f.victim_request_ids if v)
        row["victim_tenant_ids"].update(v if v else NEVER_WRITTEN for v in f.victim_tenant_ids)
        row["first_ns"], row["last_ns"] = min(row["first_ns"], f.first_ns), max(row["last_ns"], f.last_ns)
    responses = responses_by_request(con)
    rows = []
    for (rid, tenant), row in by_request.items():
        if w.tenant is not None and row["tenant_id"] != w.tenant and w.tenant not in row["victim_tenant_ids"]:
            continue
        if w.node is not None and w.node not in {n for n, _ in row["foreign_pages"]}:
            continue
        status, prompt, completion = response_of(responses, rid, tenant)
        rows.append(
            {
                "request_id": rid,
                "tenant_id": row["tenant_id"],
                "http_status": status,
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "codes": sorted(row["codes"], key=lambda c: int(c[1:])),
                "pages_read_foreign": len(row["foreign_pages"]),
                "victim_tenants": sorted(row["victim_tenant_ids"]),
                "victim_requests": sorted(row["victim_request_ids"]),
                "first_ns": row["first_ns"],
                "last_ns": row["last_ns"],
            }
        )
    ids = pl.List(pl.Utf8)
    schema: dict[str, pl.DataType | type[pl.DataType]] = {
        "request_id": pl.Utf8,
        "tenant_id": pl.Utf8,
        "http_status": pl.Int32,
        "prompt_tokens": pl.Int64,
        "completion_tokens": pl.Int64,
        "codes": ids,
        "pages_read_foreign": pl.Int64,
        "victim_tenants": ids,
        "victim_requests": ids,
        "first_ns": pl.Int64,
        "last_ns": pl.Int64,
    }
    return pl.DataFrame(rows, schema=schema).sort("first_ns")


def affected_with_exclusions(
    con: duckdb.DuckDBPyConnection, w: Window, excl: Exclusions, found: list[Finding] | None = None
) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """(kept affected responses, excluded ones with reason, every excluded request) for a window
    (``found``: the window's findings, when the caller already has them)."""
    check_exclusions(con, excl)
    excluded = excluded_requests(con, excl)
    kept, dropped = split_excluded(affected_responses(con, w, found), excluded, excl)
    return kept, dropped, excluded


# --- one function per question ---------------------------------------------------------------------

Store = str | Path | duckdb.DuckDBPyConnection


@dataclass(frozen=True)
class Answer:
    """A question's answer: ``rows``, the rows exclusions left out (``excluded``, with ``excluded_by``
    and ``reason`` where known), the store's coverage gaps, notes in words (e.g. the threshold finding)
    and integrity ``warnings`` about the record itself (e.g. a transfer id shared by several requests)."""

    rows: pl.DataFrame
    excluded: pl.DataFrame
    gaps: pl.DataFrame
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    summary: dict = field(default_factory=dict)
    found: tuple[Finding, ...] = ()  # the findings behind the rows, where the question replayed them


def require_store(db: str | Path) -> str:
    """``db`` as a string when a store file is there; a missing file is the caller's error (``--db``)."""
    if not Path(db).exists():
        raise KvtrailError(f"--db: store not found: {db}")
    return str(db)


def open_store(db: str | Path) -> duckdb.DuckDBPyConnection:
    """A read-only connection to the store at ``db`` (see :func:`require_store`)."""
    return connect_readonly(require_store(db))


@contextmanager
def _connected(store: Store) -> Iterator[duckdb.DuckDBPyConnection]:
    if isinstance(store, duckdb.DuckDBPyConnection):
        yield store
        return
    con = open_store(store)
    try:
        yield con
    finally:
        con.close()


def ask_findings(
    store: Store,
    w: Window = Window(),
    *,
    codes: tuple[str, ...] = (),
    engine: str = "replay",
    policy: ForensicsPolicy = ForensicsPolicy(),
    exclusions: Exclusions = Exclusions(),
    found: list[Finding] | None = None,
    context: WindowContext | None = None,
    signals: SignalPolicy = SignalPolicy(),
) -> Answer:
    """Every finding in the window (only ``codes`` when given) with evidence; excluded accounts' findings
    left out. ``Answer.found`` keeps every finding of the window (e.g. to persist them). ``found``: the
    window's findings already judged (the service's live judge), used instead of a replay; ``context``:
    the window's :func:`window_context` on the same store state, when the caller has it already. The
    engine's own signals (:mod:`~kvtrail.forensics.engine_signals`, thresholds in ``signals``) are notes:
    beside the findings they corroborate, or on their own where no rule fired."""
    bad = [c for c in codes if c not in CODES]
    if bad:
        raise KvtrailError(f"--code: unknown finding code {bad[0]!r}; known: {', '.join(CODES)}")
    with _connected(store) as con:
        check_exclusions(con, exclusions)
        if found is None:
            found = findings_of(con, w, engine=engine, policy=policy)
        else:
            check_window(con, w)  # as findings_of does
        ctx = window_context(con, w) if context is None else context
        found, withheld = withhold_incomplete(found, ctx.incomplete)
        df, excluded = findings_frame(found, w, codes), excluded_requests(con, exclusions)
        warnings = ctx.warnings(con, w, withheld=len(withheld))
        notes = ctx.notes + signal_notes(engine_signals(con, w, signals), found)
    hit = excluded_mask(excluded, exclusions)
    return Answer(df.filter(~hit), df.filter(hit), ctx.gaps, notes, warnings, found=tuple(found))


def ask_affected(
    store: Store,
    w: Window = Window(),
    *,
    exclusions: Exclusions = Exclusions(),
    found: list[Finding] | None = None,
    context: WindowContext | None = None,
) -> Answer:
    """Which responses read foreign pages in the window, and whose data it was (exclusions applied).
    ``found``: the window's findings already judged, used instead of a replay; ``context``: as for
    :func:`ask_findings`."""
    with _connected(store) as con:
        kept, dropped, _ = affected_with_exclusions(con, w, exclusions, found)
        ctx = window_context(con, w) if context is None else context
        return Answer(kept, dropped, ctx.gaps, ctx.notes, ctx.warnings(con, w))


@dataclass(frozen=True)
class WindowContext:
    """What every answer over a window carries besides its rows, from one store state: the store's coverage
    gaps, the symptom notes, and the pieces of the integrity warnings (shared transfer ids, unclean ends and
    the requests they leave incomplete, the recorders' reported losses). Questions asked of the same state
    can share one."""

    gaps: pl.DataFrame
    notes: tuple[str, ...]
    shared: pl.DataFrame
    ends: list[UncleanEnd]
    incomplete: pl.DataFrame
    losses: pl.DataFrame

    def warnings(self, con: duckdb.DuckDBPyConnection, w: Window, withheld: int = 0) -> tuple[str, ...]:
        return integrity_warnings(
            con,
            w,
            ends=self.ends,
            incomplete=self.incomplete,
            withheld=withheld,
            shared=self.shared,
            losses=self.losses,
        )


def window_context(con: duckdb.DuckDBPyConnection, w: Window) -> WindowContext:
    """The :class:`WindowContext` of window ``w`` on ``con``'s store as it is now."""
    kinds = has_kind_tables(con)
    ends = window_ends(con, w, kinds=kinds)
    return WindowContext(
        coverage_gaps(con, kinds=kinds),
        _symptom_notes(con, w, kinds=kinds),
        shared_transfer_ids(con, w, kinds=kinds),
        ends,
        incomplete_requests(con, w, ends),
        reported_losses(con, w, kinds=kinds),
    )


def ask_exposure(store: Store, w: Window = Window(), *, exclusions: Exclusions = Exclusions()) -> Answer:
    """Recipient tenant x victim tenant: responses, pages and victim requests (exclusions applied)."""
    with _connected(store) as con:
        found = findings_of(con, w, codes=AFFECTED_CODES)  # one replay for both answers
        kept, dropped, _ = affected_with_exclusions(con, w, exclusions, found)
        frame, gaps = findings_frame(found, w, tuple(sorted(AFFECTED_CODES))), coverage_gaps(con)
        warnings = integrity_warnings(con, w)
    return Answer(exposure_matrix(exposure_links(frame, set(kept["request_id"]))), dropped, gaps, warnings=warnings)


def ask_node_configurations(store: Store, w: Window = Window()) -> Answer:
    """Pool vs advertised context of every node configuration in effect during the window (F8's numbers)."""
    with _connected(store) as con:
        check_window(con, w)
        capacity, gaps = node_capacity(con, w.from_ns, w.to_ns), coverage_gaps(con)
        warnings = integrity_warnings(con, w)
    if w.node:
        capacity = capacity.filter(pl.col("node") == w.node)
    return Answer(capacity, capacity.clear(), gaps, warnings=warnings)


def ask_thresholds(store: Store, w: Window = Window(), *, exclusions: Exclusions = Exclusions()) -> Answer:
    """Pool vs context per node joined with affected vs unaffected prompts against their prefill pool; the
    threshold finding in words is the answer's note, its numbers its summary."""
    with _connected(store) as con:
        return thresholds_answer(con, w, *affected_with_exclusions(con, w, exclusions))


def thresholds_answer(
    con: duckdb.DuckDBPyConnection, w: Window, kept: pl.DataFrame, dropped: pl.DataFrame, excluded: pl.DataFrame
) -> Answer:
    """The threshold answer from the window's affected responses (``kept``, after exclusions; ``excluded``:
    the requests the exclusions removed), whichever engine found them (a store or a lake)."""
    capacity, gaps = node_capacity(con, w.from_ns, w.to_ns), coverage_gaps(con)
    requests = requests_table(con, w.from_ns, w.to_ns, kept["request_id"].to_list())
    warnings = integrity_warnings(con, w)
    requests = requests.filter(~pl.col("request_id").is_in(excluded["request_id"].to_list()))
    table, summary = thresholds_of(capacity, requests, kept, w)
    return Answer(table, dropped, gaps, (threshold_sentence(summary),), warnings, summary)


def thresholds_of(
    capacity: pl.DataFrame, requests: pl.DataFrame, kept: pl.DataFrame, w: Window
) -> tuple[pl.DataFrame, dict]:
    """The threshold table and its summary from the nodes' capacity, the window's requests and its affected
    responses (``kept``), with the window's tenant and node filters applied: the one composition the store,
    the lake and the dashboard share."""
    if w.tenant:
        requests = requests.filter(pl.col("tenant_id") == w.tenant)
    if w.node:
        requests = requests.filter(pl.col("prefill_node") == w.node)
        capacity = capacity.filter(pl.col("node") == w.node)
    by_node, summary = threshold_analysis(requests, set(kept["request_id"]))
    return thresholds_table(capacity, by_node), summary


def ask_exploitation(store: Store, options: ReportOptions, w: Window | None = None) -> Answer:
    """Per recipient tenant: over-long prompts in the window vs its own baseline, bursts, and a verdict.
    The note names the over-long threshold; ``summary["long_prompt_tokens"]`` holds it."""
    with _connected(store) as con:
        df, long_tokens = exploitation_for(con, options, w)
        gaps = coverage_gaps(con)
        warnings = integrity_warnings(con, w or Window(options.from_ns, options.to_ns))
    if w is not None and w.tenant:
        df = df.filter(pl.col("tenant_id") == w.tenant)
    note = (
        f"over-long: more than {long_tokens:,} tokens"
        if long_tokens is not None
        else "over-long: unknown (no node configuration in the window)"
    )
    return Answer(df, df.clear(), gaps, (note,), warnings, {"long_prompt_tokens": long_tokens})


def _symptom_notes(con: duckdb.DuckDBPyConnection, w: Window, *, kinds: bool | None = None) -> tuple[str, ...]:
    notes = (
        empty_after_abort_note(empty_after_abort(con, w, kinds=kinds)),
        unverified_landings_note(unverified_landings(con, w, kinds=kinds)),
    )
    return tuple(n for n in notes if n)


def report_requests(
    con: duckdb.DuckDBPyConnection, o: ReportOptions, kept: pl.DataFrame, dropped: pl.DataFrame
) -> pl.DataFrame:
    """Requests of the window, plus affected ones received before it."""
    return requests_table(con, o.from_ns, o.to_ns, kept["request_id"].to_list() + dropped["request_id"].to_list())


def exploitation_for(
    con: duckdb.DuckDBPyConnection, o: ReportOptions, w: Window | None = None, pieces: tuple | None = None
) -> tuple[pl.DataFrame, int | None]:
    """The exploitation assessment for the options' window and its over-long threshold (tokens).

    ``pieces`` (kept, dropped, excluded, capacity, requests) saves recomputing what the caller has.
    """
    if pieces is None:
        kept, dropped, excluded = affected_with_exclusions(con, w or Window(o.from_ns, o.to_ns), o.exclusions)
        pieces = (
            kept,
            dropped,
            excluded,
            node_capacity(con, o.from_ns, o.to_ns),
            report_requests(con, o, kept, dropped),
        )
    kept, dropped, excluded, capacity, requests = pieces
    long_tokens = o.long_prompt_tokens if o.long_prompt_tokens is not None else long_prompt_threshold(capacity)
    b_from, b_to = o.baseline
    everyone = pl.concat([kept, dropped.drop("excluded_by", "reason")])
    df = exploitation_assessment(
        requests,
        requests_table(con, b_from, b_to),
        everyone,
        excluded,
        window_ns=(o.from_ns, o.to_ns),
        baseline_ns=(b_from, b_to),
        long_prompt_tokens=long_tokens,
        rules=o.rules,
    )
    return df, long_tokens
