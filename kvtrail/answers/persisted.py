"""Persisted findings (``forensics findings --save``, the live judge) as the dashboard reads them.

A run whose window covers the asked one holds every finding of it, so the views read those rows instead
of replaying the window. Only reads: a store whose ``findings`` tables were never created has none.
"""

from __future__ import annotations

import duckdb

from kvtrail import forensics as fx


def has_tables(con: duckdb.DuckDBPyConnection) -> bool:
    row = con.execute("SELECT count(*) FROM information_schema.tables "
                      "WHERE table_name IN ('findings', 'forensic_runs')").fetchall()[0]
    return bool(row and row[0] == 2)


def covering_run(con: duckdb.DuckDBPyConnection, from_ns: int | None, to_ns: int | None) -> int | None:
    """The newest run with the default policy whose window covers [from_ns, to_ns] and that judged every
    event committed so far (a later batch may hold findings the run never saw), or None."""
    if not has_tables(con):
        return None
    row = con.execute("""
        SELECT max(run_id) FROM forensic_runs
        WHERE (from_ns IS NULL OR (? IS NOT NULL AND from_ns <= ?))
          AND (to_ns IS NULL OR (? IS NOT NULL AND to_ns >= ?))
          AND policy = ? AND run_ns >= (SELECT coalesce(max(committed_ns), 0) FROM batches)""",
                      [from_ns, from_ns, to_ns, to_ns, _default_policy()]).fetchall()[0]
    return None if row is None or row[0] is None else int(row[0])


def _default_policy() -> str:
    import json
    from dataclasses import asdict

    return json.dumps(asdict(fx.ForensicsPolicy()), sort_keys=True)


def persisted_findings(con: duckdb.DuckDBPyConnection, from_ns: int | None, to_ns: int | None) -> list[fx.Finding]:
    """The persisted findings that end inside the window, as :class:`~kvtrail.forensics.Finding` records."""
    if not has_tables(con):
        return []
    # stored_findings creates missing tables first, which a read-only connection may not do.
    rows = con.sql("SELECT * FROM findings WHERE last_ns BETWEEN ? AND ? ORDER BY last_ns, first_ns, code",
                   params=[0 if from_ns is None else from_ns, 2**63 - 1 if to_ns is None else to_ns]).to_arrow_table()
    out: list[fx.Finding] = []
    for r in rows.to_pylist():
        out.append(fx.Finding(
            code=r["code"], node=r["node"], request_id=r["request_id"], tenant_id=r["tenant_id"],
            victim_request_ids=tuple(r["victim_request_ids"] or ()),
            victim_tenant_ids=tuple(r["victim_tenant_ids"] or ()),
            pages=tuple(r["pages"] or ()), first_ns=r["first_ns"], last_ns=r["last_ns"], severity=r["severity"],
            evidence=tuple((e["producer_id"], e["seq"]) for e in r["evidence"] or ()), detail=r["detail"] or "",
            lineage_checked=r["lineage_checked"] or 0, lineage_matched=r["lineage_matched"] or 0))
    return out
