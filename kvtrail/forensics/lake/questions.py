"""The forensics questions on a lake: the replay fanned out per (node, hour), the rest as on one store.

:func:`lake_findings` plans the tasks (:mod:`kvtrail.forensics.lake.plan`), runs them on an
:class:`~kvtrail.forensics.lake.executor.Executor` and resolves what crosses partitions
(:mod:`kvtrail.forensics.lake.merge`);
its findings equal :func:`kvtrail.forensics.replay.engine.replay_store`'s on the store the lake was
exported from. The ``ask_lake_*`` functions answer like their ``kvtrail.forensics.ask_*`` namesakes,
with the questions' SQL (responses, symptoms, coverage, exclusions, thresholds) run on the lake's catalog.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import duckdb
import polars as pl

from kvtrail.audit.lake.catalog import STORE_TABLES, open_catalog
from kvtrail.audit.lake.fs import LakeFS
from kvtrail.audit.lake.manifest import LakeManifest, read_manifest, require_manifest
from kvtrail.errors import KvtrailError
from kvtrail.forensics.analysis import (
    check_exclusions,
    excluded_requests,
    exposure_links,
    exposure_matrix,
    node_capacity,
)
from kvtrail.forensics.analysis.exclusions import Exclusions, excluded_mask
from kvtrail.forensics.engine_signals import SignalPolicy, engine_signals, signal_notes
from kvtrail.forensics.findings import AFFECTED_CODES, CODES, Finding
from kvtrail.forensics.lake.executor import Executor, LocalExecutor, map_largest_first
from kvtrail.forensics.lake.groups import group_tasks, run_planned
from kvtrail.forensics.lake.merge import merged_findings
from kvtrail.forensics.lake.plan import plan_tasks
from kvtrail.forensics.lake.sqltask import sql_lake_findings
from kvtrail.forensics.lake.task import LakeCoverageError
from kvtrail.forensics.options import ReportOptions
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.questions import (
    Answer,
    affected_with_exclusions,
    coverage_gaps,
    exploitation_for,
    findings_frame,
    report_requests,
    thresholds_answer,
)
from kvtrail.forensics.replay.batch import JOIN_CODES
from kvtrail.forensics.symptoms import (
    empty_after_abort,
    empty_after_abort_note,
    incomplete_requests,
    integrity_warnings,
    window_ends,
    withhold_incomplete,
)
from kvtrail.forensics.window import Window, check_window


@dataclass(frozen=True)
class Lake:
    """An opened lake: where it is, its current manifest and a catalog connection over its listed files."""

    fs: LakeFS
    manifest: LakeManifest
    con: duckdb.DuckDBPyConnection


@contextmanager
def open_lake(url: str, number: int | None = None) -> Iterator[Lake]:
    """The lake at ``url`` as of its current manifest (or manifest ``number``: the files it listed)."""
    lake = LakeFS.open(url)
    m = require_manifest(lake) if number is None else read_manifest(lake, number)
    files = {t: sorted(m.files_of(t)) for t in STORE_TABLES}
    present = set(lake.list())
    gone = sorted(p for t in files.values() for p in t if p not in present)
    if gone:
        raise LakeCoverageError(
            f"lake {url}: partition file missing: {gone[0]} (and {len(gone) - 1} more); "
            "no answer from less data (kvtrail lake verify names every problem)"
        )
    con = open_catalog(lake, files)
    try:
        yield Lake(lake, m, con)
    finally:
        con.close()


def lake_findings(
    lake: Lake,
    w: Window,
    *,
    policy: ForensicsPolicy = ForensicsPolicy(),
    codes=None,
    executor: Executor | None = None,
    engine: str = "replay",
) -> list[Finding]:
    """Every finding of the window (tenant and node filters not applied), as one store's replay finds them
    (``engine="sql"``: the SQL engine per partition, :mod:`kvtrail.forensics.lake.sqltask`)."""
    check_window(lake.con, w)
    wanted = None if codes is None else tuple(codes)
    if engine == "sql":
        return sql_lake_findings(lake, w.from_ns, w.to_ns, policy, wanted, executor)
    if engine != "replay":
        raise KvtrailError(f"--engine: unknown findings engine {engine!r}; known: replay, sql")
    need_joins = wanted is None or bool(set(wanted) & JOIN_CODES)
    tasks = plan_tasks(lake.fs, lake.manifest, lake.con, w.from_ns, w.to_ns, policy, wanted, need_joins=need_joins)
    executor = executor or LocalExecutor()
    planned = group_tasks(tasks, executor.slots())
    results = map_largest_first(executor, run_planned, planned, lambda t: t.cost, label="partitions")
    return merged_findings(results, policy, wanted, w.from_ns, need_joins=need_joins)


def _notes(con: duckdb.DuckDBPyConnection, w: Window) -> tuple[str, ...]:
    note = empty_after_abort_note(empty_after_abort(con, w))
    return (note,) if note else ()


def ask_lake_findings(
    lake: Lake,
    w: Window = Window(),
    *,
    codes: tuple[str, ...] = (),
    policy: ForensicsPolicy = ForensicsPolicy(),
    exclusions: Exclusions = Exclusions(),
    executor: Executor | None = None,
    engine: str = "replay",
    signals: SignalPolicy = SignalPolicy(),
) -> Answer:
    """:func:`kvtrail.forensics.ask_findings` on a lake."""
    bad = [c for c in codes if c not in CODES]
    if bad:
        raise KvtrailError(f"--code: unknown finding code {bad[0]!r}; known: {', '.join(CODES)}")
    con = lake.con
    check_exclusions(con, exclusions)
    ends = window_ends(con, w)
    incomplete = incomplete_requests(con, w, ends)
    found, withheld = withhold_incomplete(
        lake_findings(lake, w, policy=policy, executor=executor, engine=engine), incomplete
    )
    df, excluded, gaps = findings_frame(found, w, codes), excluded_requests(con, exclusions), coverage_gaps(con)
    warnings = integrity_warnings(con, w, ends=ends, incomplete=incomplete, withheld=len(withheld))
    hit = excluded_mask(excluded, exclusions)
    notes = _notes(con, w) + signal_notes(engine_signals(con, w, signals), found)  # as the store's answer says them
    return Answer(df.filter(~hit), df.filter(hit), gaps, notes, warnings, found=tuple(found))


def ask_lake_affected(
    lake: Lake, w: Window = Window(), *, exclusions: Exclusions = Exclusions(), executor: Executor | None = None
) -> Answer:
    """:func:`kvtrail.forensics.ask_affected` on a lake."""
    con = lake.con
    found = lake_findings(lake, w, codes=AFFECTED_CODES, executor=executor)
    kept, dropped, _ = affected_with_exclusions(con, w, exclusions, found)
    return Answer(kept, dropped, coverage_gaps(con), _notes(con, w), integrity_warnings(con, w))


def ask_lake_exposure(
    lake: Lake, w: Window = Window(), *, exclusions: Exclusions = Exclusions(), executor: Executor | None = None
) -> Answer:
    """:func:`kvtrail.forensics.ask_exposure` on a lake."""
    con = lake.con
    found = lake_findings(lake, w, codes=AFFECTED_CODES, executor=executor)
    kept, dropped, _ = affected_with_exclusions(con, w, exclusions, found)
    frame, gaps = findings_frame(found, w, tuple(sorted(AFFECTED_CODES))), coverage_gaps(con)
    return Answer(
        exposure_matrix(exposure_links(frame, set(kept["request_id"]))),
        dropped,
        gaps,
        warnings=integrity_warnings(con, w),
    )


def ask_lake_thresholds(
    lake: Lake, w: Window = Window(), *, exclusions: Exclusions = Exclusions(), executor: Executor | None = None
) -> Answer:
    """:func:`kvtrail.forensics.ask_thresholds` on a lake."""
    con = lake.con
    found = lake_findings(lake, w, codes=AFFECTED_CODES, executor=executor)
    return thresholds_answer(con, w, *affected_with_exclusions(con, w, exclusions, found))


def ask_lake_exploitation(
    lake: Lake, options: ReportOptions, w: Window | None = None, *, executor: Executor | None = None
) -> Answer:
    """:func:`kvtrail.forensics.ask_exploitation` on a lake."""
    con, win = lake.con, w or Window(options.from_ns, options.to_ns)
    found = lake_findings(lake, Window(options.from_ns, options.to_ns), codes=AFFECTED_CODES, executor=executor)
    kept, dropped, excluded = affected_with_exclusions(
        con, Window(options.from_ns, options.to_ns), options.exclusions, found
    )
    pieces = (
        kept,
        dropped,
        excluded,
        node_capacity(con, options.from_ns, options.to_ns),
        report_requests(con, options, kept, dropped),
    )
    df, long_tokens = exploitation_for(con, options, w, pieces)
    if w is not None and w.tenant:
        df = df.filter(pl.col("tenant_id") == w.tenant)
    note = (
        f"over-long: more than {long_tokens:,} tokens"
        if long_tokens is not None
        else "over-long: unknown (no node configuration in the window)"
    )
    return Answer(
        df, df.clear(), coverage_gaps(con), (note,), integrity_warnings(con, win), {"long_prompt_tokens": long_tokens}
    )
