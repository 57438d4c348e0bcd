"""Findings kept in the store: every run over a window is recorded, and re-running it is idempotent.

A finding's id is the SHA-256 of what identifies it (code, node, request, pages, evidence event ids),
so the same finding found again - by a re-run over the same window, an overlapping window, or the
other engine - is the same row. ``forensic_runs`` records each run (window, engine, policy, how many
findings it saw and how many were new) and a digest of its result set, so two runs can be compared
without re-reading their rows. The tables live in the audit store's DuckDB file beside the events;
they are derived data and are not part of the hash chain (``kvtrail audit verify`` does not cover them,
and re-running forensics can always rebuild them). A save also keeps the per-minute aggregates
(:mod:`kvtrail.forensics.results.aggregates`) in the same transaction: the findings counts of the minutes its
findings end in, and, unless the caller keeps the event counters itself (the live judge, batch by
batch), every minute of the run's window recomputed from the events.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass

import duckdb
import pyarrow as pa

from kvtrail.forensics.findings import Finding, findings_table
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.results import aggregates

_DDL = (
    "CREATE TABLE IF NOT EXISTS forensic_runs (run_id BIGINT PRIMARY KEY, run_ns BIGINT NOT NULL, "
    "from_ns BIGINT, to_ns BIGINT, engine VARCHAR NOT NULL, policy VARCHAR NOT NULL, "
    "num_findings BIGINT NOT NULL, num_new BIGINT NOT NULL, results_digest VARCHAR NOT NULL)",
    "CREATE TABLE IF NOT EXISTS findings (finding_id VARCHAR PRIMARY KEY, code VARCHAR NOT NULL, "
    "title VARCHAR NOT NULL, severity VARCHAR NOT NULL, node VARCHAR, request_id VARCHAR, tenant_id VARCHAR, "
    "victim_request_ids VARCHAR[], victim_tenant_ids VARCHAR[], pages INTEGER[], first_ns BIGINT NOT NULL, "
    "last_ns BIGINT NOT NULL, evidence STRUCT(producer_id BIGINT, seq UBIGINT)[], detail VARCHAR, "
    "lineage_checked INTEGER, lineage_matched INTEGER, first_run_id BIGINT NOT NULL, last_run_id BIGINT NOT NULL)",
)


def finding_id(f: Finding) -> str:
    """Stable id of a finding: what identifies it, not how it is worded."""
    key = json.dumps(
        [f.code, f.node, f.request_id, list(f.pages), [list(e) for e in f.evidence]], separators=(",", ":")
    )
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def results_digest(findings: list[Finding]) -> str:
    """SHA-256 over the sorted finding ids: equal for equal result sets, whatever their order."""
    return hashlib.sha256("\n".join(sorted(finding_id(f) for f in findings)).encode()).hexdigest()


@dataclass(frozen=True)
class RunRecord:
    run_id: int
    num_findings: int
    num_new: int
    results_digest: str


def ensure_tables(con: duckdb.DuckDBPyConnection) -> None:
    for ddl in _DDL:
        con.execute(ddl)


def save_findings(
    con: duckdb.DuckDBPyConnection,
    findings: list[Finding],
    *,
    from_ns: int | None,
    to_ns: int | None,
    engine: str,
    policy: ForensicsPolicy = ForensicsPolicy(),
    recompute_aggregates: bool = True,
) -> RunRecord:
    """Record one run and its findings in one transaction; findings already stored are not duplicated.

    The findings counts of the minutes they end in are rebuilt; ``recompute_aggregates`` also rebuilds
    the event counters of every minute of [from_ns, to_ns] (the whole store when unbounded). A caller that
    adds the committed batches with :func:`kvtrail.forensics.results.aggregates.add_batches` passes False."""
    ensure_tables(con)
    con.complete()
    con.begin()
    try:
        run_id = con.execute("SELECT coalesce(max(run_id), 0) + 1 FROM forensic_runs").fetchall()[0][0]
        table = findings_table(findings)
        ids = [finding_id(f) for f in findings]
        table = table.append_column("finding_id", pa.array(ids, pa.string()))
        con.register("_new_findings", table)
        known = {
            r[0]
            for r in con.execute(
                "SELECT finding_id FROM findings WHERE finding_id IN (SELECT finding_id FROM _new_findings)"
            ).fetchall()
        }
        con.execute(
            "INSERT INTO findings SELECT DISTINCT ON (finding_id) finding_id, code, title, severity, node, request_id, "
            "tenant_id, victim_request_ids, victim_tenant_ids, pages, first_ns, last_ns, evidence, detail, "
            "lineage_checked, lineage_matched, ?, ? FROM _new_findings "
            "WHERE finding_id NOT IN (SELECT finding_id FROM findings)",
            [run_id, run_id],
        )
        con.execute(
            "UPDATE findings SET last_run_id = ? WHERE finding_id IN (SELECT finding_id FROM _new_findings)", [run_id]
        )
        aggregates.findings_saved(con, "_new_findings")
        con.unregister("_new_findings")
        if recompute_aggregates:
            aggregates.recompute_in(con, from_ns, to_ns)
        record = RunRecord(run_id, len(set(ids)), len(set(ids) - known), results_digest(findings))
        con.execute(
            "INSERT INTO forensic_runs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                run_id,
                time.time_ns(),
                from_ns,
                to_ns,
                engine,
                json.dumps(asdict(policy), sort_keys=True),
                record.num_findings,
                record.num_new,
                record.results_digest,
            ],
        )
        con.commit()
    except Exception:
        con.rollback()
        raise
    return record


def stored_findings(con: duckdb.DuckDBPyConnection, from_ns: int | None = None, to_ns: int | None = None) -> pa.Table:
    """Persisted findings overlapping [from_ns, to_ns] (all when unbounded), oldest first."""
    ensure_tables(con)
    where, params = ["TRUE"], []
    if from_ns is not None:
        where.append("last_ns >= ?")
        params.append(from_ns)
    if to_ns is not None:
        where.append("first_ns <= ?")
        params.append(to_ns)
    return con.sql(
        f"SELECT * FROM findings WHERE {' AND '.join(where)} ORDER BY last_ns, first_ns, code", params=params
    ).to_arrow_table()
