"""The Prometheus collector: every kvtrail metric computed from the audit store when it is scraped.

No counter is kept beside the store (it could drift from the audit): each scrape opens a cursor, reads
the latest node configurations, the persisted findings, the batches and the recorders' gap events,
and closes it. Only the live judge's progress and what its model monitors found are not in the store;
the service passes them in (counted at scrape time from what the judge holds).

Findings counters are listed at zero for every configured node and code, so a rule's ``increase()``
sees the first finding of a node arrive instead of a series that starts at one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Protocol, cast

import duckdb
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtrail.alerts.metrics import ABORT_CAUSES, BY_NAME, METRICS
from kvtrail.audit.configs import latest_configs, unaudited_paths
from kvtrail.forensics import AFFECTED_CODES, CODES
from kvtrail.model.properties import PROPERTIES

# {producer_id: last batch_no the live judge has read}
JudgeProgress = Callable[[], dict[int, int]]
# {(property, node): violations} the live judge's model monitors hold
ModelViolations = Callable[[], dict[tuple[str, str], int]]


class _Cursors(Protocol):
    def cursor(self) -> duckdb.DuckDBPyConnection: ...


# A client that goes away shows as HTTP 499 (nginx's code, SGLang's abort on disconnect) or says so.
_CAUSE_SQL = """
CASE WHEN http_status = 499 OR lower(abort_reason) LIKE '%disconnect%' THEN 'client_disconnect'
     WHEN http_status IN (408, 504) OR lower(abort_reason) LIKE '%timeout%' OR lower(abort_reason) LIKE '%timed out%'
          THEN 'timeout'
     ELSE 'error' END"""
_PRODUCER_SQL = """
WITH b AS (SELECT p.cluster || '/' || p.node || '/' || p.role AS producer, p.node, p.role, b.*
           FROM batches b JOIN producers p USING (producer_id)),
inst AS (SELECT producer_id, max(last_seq) - min(first_seq) + 1 - sum(num_events) AS missing
         FROM batches GROUP BY producer_id)
SELECT producer, node, role, sum(num_events), sum(num_page_events), max(committed_ns),
       arg_max(committed_ns - max_wall_ns, committed_ns),
       (SELECT sum(i.missing) FROM inst i JOIN producers q USING (producer_id)
        WHERE q.cluster || '/' || q.node || '/' || q.role = b.producer)
FROM b GROUP BY producer, node, role ORDER BY producer"""
# F2 and F3 by pair: the prefill node of a send in the finding's evidence (the transfer's source).
UNKNOWN_PREFILL = "(unknown)"
_PAIRS_SQL = f"""
SELECT f.code, coalesce((SELECT min(p.node) FROM (SELECT unnest(f.evidence) AS ev) e
                         JOIN producers p ON p.producer_id = e.ev.producer_id WHERE p.role = 'prefill'),
                        '{UNKNOWN_PREFILL}'),
       coalesce(f.node, ''), count(*)
FROM findings f WHERE f.code IN ('F2', 'F3') GROUP BY ALL ORDER BY ALL"""
_GAPS_SQL = """
SELECT cluster || '/' || node || '/' || role, coalesce(sum(dropped_events), 0)
FROM events_v WHERE kind = 'recorder_gap' GROUP BY ALL"""
# The latest instance of each producer: started (it frames its events) and not closed cleanly.
_OPEN_SQL = """
WITH latest AS (SELECT cluster || '/' || node || '/' || role AS producer, producer_id
                FROM producers QUALIFY row_number() OVER (PARTITION BY cluster, node, role
                                                          ORDER BY first_seen_ns DESC, producer_id DESC) = 1)
SELECT l.producer,
       EXISTS (SELECT 1 FROM events_recorder_started s WHERE s.producer_id = l.producer_id)
       AND NOT EXISTS (SELECT 1 FROM events_recorder_closed c WHERE c.producer_id = l.producer_id)
FROM latest l"""


def _has_table(con: duckdb.DuckDBPyConnection, name: str) -> bool:
    row = con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = ?", [name]).fetchone()
    return row is not None and bool(row[0])


Family = GaugeMetricFamily | CounterMetricFamily


def _family(name: str) -> Family:
    spec = BY_NAME[name]
    if spec.kind == "counter":
        return CounterMetricFamily(name, spec.doc, labels=spec.labels)
    return GaugeMetricFamily(name, spec.doc, labels=spec.labels)


class StoreCollector(Collector):
    """A prometheus-client collector over one store. ``source``: an object with ``cursor()`` (an
    ``AuditStore``) or a function returning a fresh connection; ``judge_progress``: the live judge's
    per-producer watermark, for ``kvtrail_judge_lag_seconds``; ``model_violations``: the live judge's
    model violations, for ``kvtrail_model_violations_total`` (each left out without it)."""

    def __init__(
        self,
        source: _Cursors | Callable[[], duckdb.DuckDBPyConnection],
        *,
        judge_progress: JudgeProgress | None = None,
        model_violations: ModelViolations | None = None,
    ):
        cursor = getattr(source, "cursor", None)
        self._connect = cast(Callable[[], duckdb.DuckDBPyConnection], source if cursor is None else cursor)
        self._judge_progress = judge_progress
        self._model_violations = model_violations

    def describe(self) -> Iterator[Metric]:
        return iter(())  # the families depend on the store: no checks at registration

    def collect(self) -> Iterator[Metric]:
        con = self._connect()
        try:
            con.execute("BEGIN")  # one snapshot for the whole scrape
            families = [*self._nodes(con), *self._findings(con), self._aborts(con), *self._producers(con)]
            con.execute("COMMIT")
        finally:
            con.close()
        return iter(families)

    # ---- node configuration ---------------------------------------------------------------------

    def _nodes(self, con: duckdb.DuckDBPyConnection) -> list[Metric]:
        specs = [(m, m.column) for m in METRICS if m.column is not None]
        fams: dict[str, Family] = {m.name: _family(m.name) for m, _ in specs}
        info = InfoMetricFamily("kvtrail_node_engine", BY_NAME["kvtrail_node_engine"].doc, labels=["node", "role"])
        unaudited = _family("kvtrail_node_unaudited_paths")
        configs = latest_configs(
            con,
            ("node", "role", "engine", "engine_version", "config_source", *(c for _, c in specs)),
            per=("node", "role"),
            order_by=("node", "role"),
        ).to_pylist()
        for row in configs:
            labels = [row["node"], row["role"]]
            for m, column in specs:
                v = row[column]
                if v is not None:  # unknown stays absent, never a number
                    fams[m.name].add_metric(labels, float(v) / m.per_unit)
            info.add_metric(labels, {"engine": row["engine"], "version": row["engine_version"]})
            for path in unaudited_paths(row["config_source"]):  # what the node itself declares it does not audit
                unaudited.add_metric([*labels, path], 1.0)
        return [*fams.values(), info, unaudited]

    # ---- findings -------------------------------------------------------------------------------

    def _findings(self, con: duckdb.DuckDBPyConnection) -> list[Metric]:
        nodes = [
            r[0]
            for r in con.execute(
                "SELECT DISTINCT node FROM events_v WHERE kind = 'node_config' ORDER BY node"
            ).fetchall()
        ]
        counts: dict[tuple[str, str], int] = {(code, n): 0 for code in CODES for n in nodes}
        affected: dict[str, int] = dict.fromkeys(nodes, 0)
        if _has_table(con, "findings"):
            for code, node, n in con.execute(
                "SELECT code, coalesce(node, ''), count(*) FROM findings GROUP BY ALL"
            ).fetchall():
                counts[(code, node)] = n
            codes = sorted(AFFECTED_CODES)
            for node, n in con.execute(
                f"SELECT coalesce(node, ''), count(DISTINCT request_id) FROM findings "
                f"WHERE code IN ({', '.join('?' for _ in codes)}) GROUP BY ALL",
                codes,
            ).fetchall():
                affected[node] = n
        total = _family("kvtrail_forensics_findings")
        for (code, node), n in sorted(counts.items()):
            total.add_metric([code, node], n)
        out: list[Metric] = [total]
        aff = _family("kvtrail_forensics_affected_responses")
        for node, n in sorted(affected.items()):
            aff.add_metric([node], n)
        out.append(aff)
        for name, code in (
            ("kvtrail_forensics_transfer_length_mismatches", "F2"),
            ("kvtrail_forensics_digest_mismatches", "F3"),
            ("kvtrail_forensics_rejected_but_served", "F4"),
            ("kvtrail_forensics_late_transfers", "F11"),
        ):
            fam = _family(name)
            for (c, node), n in sorted(counts.items()):
                if c == code:
                    fam.add_metric([node], n)
            out.append(fam)
        pairs = _family("kvtrail_forensics_transfer_pair_mismatches")
        for code, prefill, decode, n in con.execute(_PAIRS_SQL).fetchall() if _has_table(con, "findings") else []:
            pairs.add_metric([code, prefill, decode], n)
        out.append(pairs)
        if self._model_violations is not None:
            out.append(self._model(nodes))
        return out

    def _model(self, nodes: list[str]) -> Metric:
        """Listed at zero for every property and configured node, like the findings counters."""
        counts = {(prop, n): 0 for prop in PROPERTIES for n in nodes}
        counts.update(self._model_violations() if self._model_violations is not None else {})
        fam = _family("kvtrail_model_violations")
        for labels, n in sorted(counts.items()):
            fam.add_metric(list(labels), n)
        return fam

    # ---- transfers ------------------------------------------------------------------------------

    def _aborts(self, con: duckdb.DuckDBPyConnection) -> Metric:
        counts = {
            (n, r, c): 0
            for n, r in con.execute("SELECT DISTINCT node, role FROM events_v WHERE kind = 'node_config'").fetchall()
            for c in ABORT_CAUSES
        }
        for node, role, cause, n in con.execute(
            f"SELECT node, role, {_CAUSE_SQL} AS cause, count(*) FROM events_v "
            "WHERE kind = 'request_aborted' AND stage = 'transfer' GROUP BY ALL"
        ).fetchall():
            counts[(node, role, cause)] = n
        fam = _family("kvtrail_transfer_aborts")
        for labels, n in sorted(counts.items()):
            fam.add_metric(list(labels), n)
        return fam

    # ---- producers ------------------------------------------------------------------------------

    def _producers(self, con: duckdb.DuckDBPyConnection) -> list[Metric]:
        names = (
            "kvtrail_ingest_events",
            "kvtrail_ingest_page_events",
            "kvtrail_ingest_last_batch_timestamp_seconds",
            "kvtrail_ingest_lag_seconds",
            "kvtrail_ingest_producer_open",
            "kvtrail_recorder_dropped_events",
            "kvtrail_recorder_missing_events",
            "kvtrail_recorder_explained_missing_events",
        )
        fams = {n: _family(n) for n in names}
        dropped = dict(con.execute(_GAPS_SQL).fetchall())
        is_open = dict(con.execute(_OPEN_SQL).fetchall())
        labels_of: dict[str, list[str]] = {}
        for producer, node, role, n_ev, n_page, last_ns, lag_ns, missing in con.execute(_PRODUCER_SQL).fetchall():
            labels = labels_of[producer] = [producer, node, role]
            gaps = int(dropped.get(producer, 0))
            for n, v in zip(
                names,
                (
                    n_ev,
                    n_page,
                    last_ns / 1e9,
                    max(0, lag_ns) / 1e9,
                    int(bool(is_open.get(producer))),
                    gaps,
                    missing,
                    min(gaps, int(missing)),
                ),
            ):
                fams[n].add_metric(labels, float(v))
        out: list[Metric] = list(fams.values())
        if self._judge_progress is not None:
            out.append(self._judge_lag(con, labels_of))
        return out

    def _judge_lag(self, con: duckdb.DuckDBPyConnection, labels_of: dict[str, list[str]]) -> Metric:
        judged = self._judge_progress() if self._judge_progress is not None else {}
        now_ns = time.time_ns()
        lag: dict[str, float] = dict.fromkeys(labels_of, 0.0)
        for producer, oldest_ns in con.execute(
            "WITH w AS (SELECT unnest(?::BIGINT[]) AS producer_id, unnest(?::BIGINT[]) AS judged) "
            "SELECT p.cluster || '/' || p.node || '/' || p.role, min(b.committed_ns) FROM batches b "
            "JOIN producers p USING (producer_id) LEFT JOIN w USING (producer_id) "
            "WHERE b.batch_no > coalesce(w.judged, -1) GROUP BY ALL",
            [list(judged), list(judged.values())],
        ).fetchall():
            lag[producer] = max(0, now_ns - oldest_ns) / 1e9
        fam = _family("kvtrail_judge_lag_seconds")
        for producer, v in sorted(lag.items()):
            fam.add_metric(labels_of.get(producer, [producer, "", ""]), v)
        return fam


def collector(
    store: _Cursors | Callable[[], duckdb.DuckDBPyConnection],
    *,
    judge_progress: JudgeProgress | None = None,
    model_violations: ModelViolations | None = None,
) -> StoreCollector:
    """A collector over ``store`` to register in a ``prometheus_client`` registry."""
    return StoreCollector(store, judge_progress=judge_progress, model_violations=model_violations)
