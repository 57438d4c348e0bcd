"""One fan-out task: the replay of one node's partition (or, where checkpoints cannot stand in, of its
whole window), and what it hands the second stage.

Modes: ``pages`` replays the partition's events from the checkpoint at its hour's start (or from an
empty state where the window's replay starts inside the hour) and returns the per-node findings plus
the cross-node joins' inputs; ``joins`` (hours before the window that its replay still reads from, see
:mod:`kvtrail.forensics.lake.plan`) collects only the joins' inputs, without page lists; ``chain`` replays
several hours of one node in order from an empty state. A task reads each file once, checks its SHA-256 against
the manifest and replays those very bytes; it refuses (``LakeCoverageError``) a missing or altered file.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from kvtrail.audit.lake.catalog import LAKE_TABLES, memory_catalog
from kvtrail.audit.lake.fs import LakeFS
from kvtrail.audit.lake.partition import HOUR_NS
from kvtrail.audit.layout import EVENTS_SCHEMA
from kvtrail.audit.store import read_events
from kvtrail.errors import KvtrailError
from kvtrail.forensics.findings import Finding
from kvtrail.forensics.lake import checkpoint
from kvtrail.forensics.lake.executor import worker_threads
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.replay.batch import JOIN_KINDS, PRODUCER_NAMES
from kvtrail.forensics.replay.engine import ReplayEngine, fast_by_default
from kvtrail.forensics.replay.joins import CrossNodeJoins
from kvtrail.forensics.replay.source import STORE_BATCH_COLUMNS, store_batches

MODES = ("pages", "joins", "chain")
# The events columns a replay task reads (its reader's and the chunk namings' query), and the strings among them.
REPLAY_COLUMNS = STORE_BATCH_COLUMNS
_DICTIONARY_COLUMNS = [f.name for f in EVENTS_SCHEMA if f.name in REPLAY_COLUMNS and pa.types.is_string(f.type)]
# The tables whose files every task of a question lists alike (the lake's own); the others are a partition's.
SHARED_TABLES = ("producers", "batches")


class LakeCoverageError(KvtrailError):
    """A partition or checkpoint a question needs is missing or does not match the manifest."""


@dataclass(frozen=True)
class PartitionTask:
    """What one task replays. ``files``: table -> (path, SHA-256) pairs; ``starts``: per producer id, the
    time from which the window's replay reads it (None: from its first event)."""

    url: str
    mode: str
    cluster: str
    node: str
    hours: tuple[int, ...]
    files: tuple[tuple[str, tuple[tuple[str, str], ...]], ...]
    checkpoint: tuple[str, str] | None  # (path, SHA-256); None: an empty state
    starts: tuple[tuple[int, int | None], ...]
    to_ns: int | None
    policy: ForensicsPolicy = ForensicsPolicy()
    codes: tuple[str, ...] | None = None
    cost: int = 0  # bytes of its files: what the fan-out orders tasks by (largest first)
    rows: int = 0  # events in its events files (what a group reads at once is bounded by)

    def __post_init__(self) -> None:
        assert self.mode in MODES, f"task mode {self.mode!r}"

    def label(self) -> str:
        return f"{self.mode} {self.cluster}/{self.node} hours {self.hours[0]}..{self.hours[-1]}"


@dataclass
class PartitionResult:
    """A task's answer: per-node findings, the joins' inputs, tenants it learned, and the node's state."""

    cluster: str
    node: str
    hours: tuple[int, ...]
    found: list[Finding] = field(default_factory=list)
    joins: CrossNodeJoins | None = None
    tenants: dict[str, str] = field(default_factory=dict)
    # request id -> the hour its tenant was first named in, where that is later than hours[0] (a group of
    # hours, kvtrail.forensics.lake.groups): the merge takes each id's first naming in hour order
    tenant_hours: dict[str, int] = field(default_factory=dict)
    # joins mode: ((cluster, node), request_id, tenant_id) -> prefix-hit pages
    hit_pages: dict[tuple[tuple[str, str], str | None, str | None], int] = field(default_factory=dict)
    events: int = 0
    page_events: int = 0


def read_checked(lake: LakeFS, path: str, sha: str) -> bytes:
    """The bytes of ``path``, refused unless they match the manifest's SHA-256."""
    try:
        data = lake.read(path)
    except KvtrailError:
        raise LakeCoverageError(f"lake {lake.url}: partition file missing: {path}; no answer from less data") from None
    if hashlib.sha256(data).hexdigest() != sha:
        raise LakeCoverageError(f"lake {lake.url}: {path} does not match the manifest (altered); no answer")
    return data


def task_filter(task: PartitionTask, lo: int, hi: int) -> tuple[str, list]:
    """The filter of the task's events in [lo, hi) (its window end and producers' starts)."""
    where = ["cluster = ?", "node = ?", "wall_ns >= ?", "wall_ns < ?"]
    params: list = [task.cluster, task.node, lo, hi]
    if task.to_ns is not None:
        where.append("wall_ns <= ?")
        params.append(task.to_ns)
    for pid, start in task.starts:
        if start is not None:
            where.append("(producer_id <> ? OR wall_ns >= ?)")
            params += [pid, start]
    return " AND ".join(where), params


def _read_events(data: bytes, columns: tuple[str, ...], many: bool) -> pa.Table:
    """``columns`` of one events file (those it has), strings as dictionaries: a replay's read decodes about
    half the bytes of the whole file, and a string column keeps its dictionary (DuckDB scans it as is)."""
    meta = pq.read_metadata(pa.BufferReader(data))
    have = set(meta.schema.to_arrow_schema().names)  # a file written before a field was added lacks its column
    strings = [c for c in _DICTIONARY_COLUMNS if c in have]  # (naming one it lacks is an error)
    f = pq.ParquetFile(pa.BufferReader(data), metadata=meta, read_dictionary=strings)
    return f.read(columns=[c for c in columns if c in have], use_threads=many)


def read_tables(
    lake: LakeFS,
    task: PartitionTask,
    threads: int | None = None,
    cache: dict | None = None,
    events_columns: tuple[str, ...] | None = None,
) -> dict[str, pa.Table]:
    """The task's files as tables, each read once: the bytes whose SHA-256 matched are the ones judged.
    ``threads``: the task's thread budget (:func:`~kvtrail.forensics.lake.executor.worker_threads`);
    ``cache``: the :data:`SHARED_TABLES` read before, by their file lists (a group of tasks reads them once);
    ``events_columns``: the only ``events`` columns the caller reads (None: all of them)."""
    many = threads is None or threads > 1

    def read(name: str, data: bytes) -> pa.Table:
        if name == "events" and events_columns is not None:
            return _read_events(data, events_columns, many)
        return pq.read_table(pa.BufferReader(data), use_threads=many)

    def table_of(name: str, entries: tuple[tuple[str, str], ...]) -> pa.Table:
        key = (name, entries)
        if cache is not None and key in cache:
            return cache[key]
        # files written before an event field was added lack its column: null there (promoted)
        table = pa.concat_tables(
            [read(name, read_checked(lake, path, sha)) for path, sha in entries], promote_options="default"
        )
        if name == "events" and events_columns is not None:  # a field none of the files has: null
            for col in events_columns:
                if col not in table.schema.names:
                    table = table.append_column(
                        EVENTS_SCHEMA.field(col), pa.nulls(table.num_rows, EVENTS_SCHEMA.field(col).type)
                    )
        if cache is not None and name in SHARED_TABLES:
            cache[key] = table
        return table

    tables = {table: table_of(table, entries) for table, entries in task.files if entries}
    if set(tables) != set(LAKE_TABLES):
        raise LakeCoverageError(
            f"lake {lake.url}: no {', '.join(sorted(set(LAKE_TABLES) - set(tables)))} files "
            f"for {task.label()}; no answer"
        )
    return tables


def events_columns(task: PartitionTask) -> tuple[str, ...] | None:
    """The events columns ``task`` reads: a replay on the fast path :data:`REPLAY_COLUMNS`; the joins' inputs
    and the reference engine every column (None)."""
    return REPLAY_COLUMNS if task.mode != "joins" and fast_by_default() else None


def run_task(task: PartitionTask) -> PartitionResult:
    """Run one task (in a worker process or in-process)."""
    lake = LakeFS.open(task.url)
    threads = worker_threads()
    with memory_catalog(read_tables(lake, task, threads, events_columns=events_columns(task)), threads) as con:
        return _run(con, lake, task, threads)


def producer_ids(con: duckdb.DuckDBPyConnection) -> dict[tuple, int]:
    """The catalog's producers: identity -> producer id (what a ReplayEngine is made with)."""
    return {
        tuple(r[1:]): r[0]
        for r in con.execute(f"SELECT producer_id, {', '.join(PRODUCER_NAMES)} FROM producers").fetchall()
    }


def replay_span(
    con: duckdb.DuckDBPyConnection,
    task: PartitionTask,
    engine: ReplayEngine,
    out: PartitionResult,
    threads: int | None,
    lo: int,
    hi: int,
) -> None:
    """Feed ``engine`` the task's events in [lo, hi) from the catalog ``con`` of its tables."""
    where, params = task_filter(task, lo, hi)
    if engine.fast_path is not None:
        for batch in store_batches(con, where, params, read_ahead=threads is None or threads > 1):
            out.events += batch.num_rows
            engine.feed_batch(batch)
    else:
        table = read_events(con, where, params)
        out.events += table.num_rows
        engine.feed(table)


def replay_hours(
    con: duckdb.DuckDBPyConnection, task: PartitionTask, engine: ReplayEngine, out: PartitionResult, threads: int | None
) -> None:
    """Feed ``engine`` the task's events, hour by hour, from the catalog ``con`` of its tables."""
    for hour in task.hours:
        replay_span(con, task, engine, out, threads, hour * HOUR_NS, (hour + 1) * HOUR_NS)


def _run(con: duckdb.DuckDBPyConnection, lake: LakeFS, task: PartitionTask, threads: int | None) -> PartitionResult:
    """The task on the catalog ``con`` of its tables."""
    out = PartitionResult(task.cluster, task.node, task.hours)
    if task.mode == "joins":
        _collect_joins(con, task, producer_ids(con), out)
        return out
    engine = ReplayEngine(producer_ids(con), task.policy, codes=task.codes)
    if task.checkpoint is not None:
        checkpoint.restore(read_checked(lake, *task.checkpoint), engine.state)
    replay_hours(con, task, engine, out, threads)
    out.found = list(engine.state.found)
    out.joins = engine.state.joins
    out.tenants = dict(engine.state.tenants)
    return out


def _collect_joins(con, task: PartitionTask, pids: dict, out: PartitionResult) -> None:
    """The joins' inputs of hours before the window: join kinds, node configs and forward writes, no pages."""
    hour = task.hours[0]
    where, params = task_filter(task, hour * HOUR_NS, (hour + 1) * HOUR_NS)
    kinds = ", ".join(f"'{k}'" for k in (*JOIN_KINDS, "node_config"))
    joined = read_events(con, f"{where} AND kind IN ({kinds})", params)
    # Forward writes are prefill-rate samples: their pages do not matter here, and are most of the data.
    writes = read_events(
        con, f"{where} AND kind = 'kv_written' AND source = 'forward' AND request_id IS NOT NULL", params
    )
    for name in ("pages", "page_digests", "block_hashes"):
        i = writes.schema.get_field_index(name)
        typ = writes.schema.field(name).type
        col = pa.array([[]] * writes.num_rows, typ) if name == "pages" else pa.nulls(writes.num_rows, typ)
        writes = writes.set_column(i, writes.schema.field(name), col)
    table = pa.concat_tables([joined, writes])
    engine = ReplayEngine(pids, task.policy, codes=task.codes, fast=False)
    engine.feed(table)
    out.events = table.num_rows
    out.joins = engine.state.joins
    out.tenants = dict(engine.state.tenants)
    hits = con.execute(
        f"SELECT cluster, node, request_id, tenant_id, sum(num_pages) FROM events_v WHERE {where} "
        "AND kind = 'pages_allocated' AND purpose = 'prefix_hit' AND num_pages > 0 GROUP BY ALL",
        params,
    ).fetchall()
    out.hit_pages = {((c, n), rid, t): int(k) for c, n, rid, t, k in hits}
