"""The questions an incident responder asks, answered from the store (Polars DataFrames).

``findings()`` lists every finding in a window; ``affected_responses()`` answers "which responses
read foreign pages during this window, and whose data was it". Both report coverage gaps: events a
producer numbered but the store does not hold (and that no ``recorder_gap`` event accounts for),
because an answer over incomplete data must say so.
"""

from __future__ import annotations

import duckdb
import polars as pl

from kvtrail.forensics.analysis.exclusions import Exclusions, check_exclusions, excluded_requests, split_excluded
from kvtrail.forensics.findings import AFFECTED_CODES, NEVER_WRITTEN, Finding, findings_table
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.replay.engine import replay_store
from kvtrail.forensics.sql.engine import sql_findings
from kvtrail.forensics.window import Window, check_window


def coverage_gaps(con: duckdb.DuckDBPyConnection) -> pl.DataFrame:
    """Per producer: sequence numbers missing from the store that no recorder_gap event explains."""
    rows = con.execute("""
        SELECT p.node, p.instance, b.first_seq, b.last_seq, b.num_events, b.pruned,
               coalesce(g.dropped, 0) AS reported
        FROM (SELECT producer_id, min(first_seq) AS first_seq, max(last_seq) AS last_seq,
                     sum(num_events) AS num_events, sum(num_events) FILTER (pruned_by IS NOT NULL) AS pruned
              FROM batches GROUP BY producer_id) b
        JOIN producers p USING (producer_id)
        LEFT JOIN (SELECT producer_id, sum(dropped_events) AS dropped FROM events
                   WHERE kind = 'recorder_gap' GROUP BY producer_id) g USING (producer_id)""").fetchall()
    out = []
    for node, instance, first, last, stored, _pruned, reported in rows:
        missing = int(last - first + 1 - stored)
        if missing > reported:
            out.append({"node": node, "instance": instance, "missing_events": missing,
                        "reported_by_producer": int(reported), "unexplained": missing - int(reported)})
    return pl.DataFrame(out, schema={"node": pl.Utf8, "instance": pl.Utf8, "missing_events": pl.Int64,
                                     "reported_by_producer": pl.Int64, "unexplained": pl.Int64})


def findings_of(con: duckdb.DuckDBPyConnection, w: Window = Window(), *, engine: str = "replay",
                policy: ForensicsPolicy = ForensicsPolicy(), codes=None) -> list[Finding]:
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
    found = [f for f in found if (not codes or f.code in codes)
             and (w.tenant is None or f.tenant_id == w.tenant or w.tenant in f.victim_tenant_ids)
             and (w.node is None or f.node == w.node)]
    return pl.from_arrow(findings_table(found))


def findings(con: duckdb.DuckDBPyConnection, w: Window = Window(), codes: tuple[str, ...] = (), *,
             engine: str = "replay", policy: ForensicsPolicy = ForensicsPolicy()) -> pl.DataFrame:
    """Every finding in the window (optionally only ``codes``), with evidence event ids."""
    return findings_frame(findings_of(con, w, engine=engine, policy=policy), w, codes)


def affected_responses(con: duckdb.DuckDBPyConnection, w: Window = Window(),
                       found: list[Finding] | None = None) -> pl.DataFrame:
    """Responses whose request read foreign pages (F1, F5, F7): who, what the client got, whose data.

    ``found``: the window's findings when the caller already has them (they are not replayed again).
    """
    if found is None:
        found = findings_of(con, w, codes=AFFECTED_CODES)
    else:
        check_window(con, w)
    found = [f for f in found if f.code in AFFECTED_CODES]
    by_request: dict[str, dict] = {}
    for f in found:
        row = by_request.setdefault(f.request_id, {
            "request_id": f.request_id, "tenant_id": f.tenant_id, "codes": set(), "foreign_pages": set(),
            "victim_request_ids": set(), "victim_tenant_ids": set(), "first_ns": f.first_ns, "last_ns": f.last_ns})
        row["codes"].add(f.code)
        row["foreign_pages"].update((f.node, p) for p in f.pages)
        row["victim_request_ids"].update(v for v in f.victim_request_ids if v)
        row["victim_tenant_ids"].update(v if v else NEVER_WRITTEN for v in f.victim_tenant_ids)
        row["first_ns"], row["last_ns"] = min(row["first_ns"], f.first_ns), max(row["last_ns"], f.last_ns)
    responses = {r[0]: r[1:] for r in con.execute(
        "SELECT request_id, http_status, prompt_tokens, completion_tokens FROM events_v "
        "WHERE kind = 'response_sent' AND request_id IS NOT NULL").fetchall()}
    rows = []
    for rid, row in by_request.items():
        if w.tenant is not None and row["tenant_id"] != w.tenant and w.tenant not in row["victim_tenant_ids"]:
            continue
        if w.node is not None and w.node not in {n for n, _ in row["foreign_pages"]}:
            continue
        status, prompt, completion = responses.get(rid, (None, None, None))
        rows.append({"request_id": rid, "tenant_id": row["tenant_id"], "http_status": status,
                     "prompt_tokens": prompt, "completion_tokens": completion,
                     "codes": ",".join(sorted(row["codes"])), "pages_read_foreign": len(row["foreign_pages"]),
                     "victim_tenants": ",".join(sorted(row["victim_tenant_ids"])),
                     "victim_requests": ",".join(sorted(row["victim_request_ids"])),
                     "first_ns": row["first_ns"], "last_ns": row["last_ns"]})
    schema = {"request_id": pl.Utf8, "tenant_id": pl.Utf8, "http_status": pl.Int32, "prompt_tokens": pl.Int64,
              "completion_tokens": pl.Int64, "codes": pl.Utf8, "pages_read_foreign": pl.Int64,
              "victim_tenants": pl.Utf8, "victim_requests": pl.Utf8, "first_ns": pl.Int64, "last_ns": pl.Int64}
    return pl.DataFrame(rows, schema=schema).sort("first_ns")


def affected_with_exclusions(con: duckdb.DuckDBPyConnection, w: Window, excl: Exclusions,
                             found: list[Finding] | None = None) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """(kept affected responses, excluded ones with reason, every excluded request) for a window
    (``found``: the window's findings, when the caller already has them)."""
    check_exclusions(con, excl)
    excluded = excluded_requests(con, excl)
    kept, dropped = split_excluded(affected_responses(con, w, found), excluded, excl)
    return kept, dropped, excluded
