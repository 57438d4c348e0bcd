"""Persisted findings (``forensics findings --save``, the live judge) as the dashboard reads them.

A run whose window covers the asked one holds every finding of it, so the views read those rows instead
of replaying the window. Only reads: a store whose ``findings`` tables were never created has none.
"""

from __future__ import annotations

import duckdb
import polars as pl

from kvtrail import forensics as fx
from kvtrail.audit.store import arrow_query
from kvtrail.forensics.results.persist import ensure_tables as ensure_findings_tables


def has_tables(con: duckdb.DuckDBPyConnection) -> bool:
    row = con.execute(
        "SELECT count(*) FROM information_schema.tables WHERE table_name IN ('findings', 'forensic_runs')"
    ).fetchall()[0]
    return bool(row and row[0] == 2)


def covering_run(con: duckdb.DuckDBPyConnection, from_ns: int | None, to_ns: int | None) -> int | None:
    """The newest run with the default policy whose window covers [from_ns, to_ns] and that judged every
    event committed so far (a later batch may hold findings the run never saw), or None."""
    if not has_tables(con):
        return None
    row = con.execute(
        """
        SELECT max(run_id) FROM forensic_runs
        WHERE (from_ns IS NULL OR (? IS NOT NULL AND from_ns <= ?))
          AND (to_ns IS NULL OR (? IS NOT NULL AND to_ns >= ?))
          AND policy = ? AND run_ns >= (SELECT coalesce(max(committed_ns), 0) FROM batches)""",
        [from_ns, from_ns, to_ns, to_ns, _default_policy()],
    ).fetchall()[0]
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
    rows = con.sql(
        "SELECT * FROM findings WHERE last_ns BETWEEN ? AND ? ORDER BY last_ns, first_ns, code",
        params=[0 if from_ns is None else from_ns, 2**63 - 1 if to_ns is None else to_ns],
    ).to_arrow_table()
    out: list[fx.Finding] = []
    for r in rows.to_pylist():
        out.append(
            fx.Finding(
                code=r["code"],
                node=r["node"],
                request_id=r["request_id"],
                tenant_id=r["tenant_id"],
                victim_request_ids=tuple(r["victim_request_ids"] or ()),
                victim_tenant_ids=tuple(r["victim_tenant_ids"] or ()),
                pages=tuple(r["pages"] or ()),
                first_ns=r["first_ns"],
                last_ns=r["last_ns"],
                severity=r["severity"],
                evidence=tuple((e["producer_id"], e["seq"]) for e in r["evidence"] or ()),
                detail=r["detail"] or "",
                lineage_checked=r["lineage_checked"] or 0,
                lineage_matched=r["lineage_matched"] or 0,
            )
        )
    return out


def persisted_since(
    cur: duckdb.DuckDBPyConnection, since: int, w: fx.Window, codes: tuple[str, ...]
) -> tuple[pl.DataFrame, int]:
    """Findings the judge persisted in runs after ``since`` (window, code, node, tenant filters) and the
    next cursor: the largest ``first_run_id`` returned, or ``since``."""
    cols = (
        "finding_id, code, title, severity, node, request_id, tenant_id, victim_request_ids, victim_tenant_ids, "
        "pages, first_ns, last_ns, evidence, detail, lineage_checked, lineage_matched, first_run_id, last_run_id"
    )
    has = cur.execute(
        "SELECT count(*) FROM duckdb_tables() WHERE table_name = 'findings' "
        "AND schema_name = 'main' AND database_name = current_database()"
    ).fetchone()
    if not has or not has[0]:  # the judge has saved nothing yet: the same columns, no rows
        mem = duckdb.connect()
        ensure_findings_tables(mem)
        return pl.DataFrame(arrow_query(mem, f"SELECT {cols} FROM findings")), since
    df = pl.DataFrame(
        arrow_query(
            cur,
            f"SELECT {cols} FROM findings WHERE first_run_id > ? AND (? IS NULL OR last_ns >= ?) "
            "AND (? IS NULL OR first_ns <= ?) AND (? IS NULL OR node = ?) "
            "AND (? IS NULL OR tenant_id = ? OR list_contains(victim_tenant_ids, ?)) "
            "AND (len(?::VARCHAR[]) = 0 OR list_contains(?::VARCHAR[], code)) ORDER BY first_run_id, last_ns, code",
            [
                since,
                w.from_ns,
                w.from_ns,
                w.to_ns,
                w.to_ns,
                w.node,
                w.node,
                w.tenant,
                w.tenant,
                w.tenant,
                list(codes),
                list(codes),
            ],
        )
    )
    return df, int(df["first_run_id"].max()) if len(df) else since  # type: ignore[arg-type]
