"""The ingest methods bench_ingest.py alternates, and the machine's limits it sets beside them.

Every method owns one DuckDB file and is fed the same batches, batch by batch (``recorder``: the same
events as the recorder's buffered tuples, turned into batches by its writer's ``build_batch``). The baselines store
page ids only; the limits store what kvtrail stores, from rows already encoded (built once, before
any timing, by reading back one untimed kvtrail ingest of the same batches), appended as Arrow with
no Python per event:

  limit-kinds   today's tables (store format 3): each kind's events into its own table, only the columns
                that kind may carry (the part's non-null ones inserted, as AuditStore does; request fields
                as the request dictionary's number), the dictionary rows new in the batch, plus
                ``page_runs``, one transaction per batch
  limit-wide    store format 1's single ``events`` table (every column of the schema), the layout before
                the kind tables, plus ``page_runs``
  limit-narrow  the narrowest tables that hold the same information: events as 10 columns (producer,
                seq, kind code, two clocks, request number, the kind's one enum as a code, token range,
                page count), a requests table (number, id, transfer id, tenant) with a row per request
                when first seen, plus ``page_runs``
"""

from __future__ import annotations

import math
from typing import Protocol

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrail.audit.events import (
    ALLOC_PURPOSES,
    FREE_REASONS,
    KIND_CODES,
    KIND_NAMES,
    PAYLOAD_LAYOUT_BY_CODE,
    WRITE_SOURCES,
    Producer,
    RequestRef,
)
from kvtrail.audit.layout import EVENTS_SCHEMA, REQUESTS_TABLE, column_type, table_name
from kvtrail.audit.store import DEFAULT_CHECKPOINT, RUN_COLUMNS, AuditStore, CheckpointPolicy, schema_ddl
from kvtrail.audit.writer import build_batch

UNBOUNDED_WAL = CheckpointPolicy(max_wal_bytes=256 * 2**20, max_interval_s=math.inf)  # before CheckpointPolicy
NARROW_DDL = (
    "CREATE TABLE events (producer_id BIGINT NOT NULL, seq UBIGINT NOT NULL, kind UTINYINT NOT NULL, "
    "wall_ns BIGINT NOT NULL, mono_ns BIGINT NOT NULL, request_no INTEGER, code UTINYINT, "
    "token_start BIGINT, token_end BIGINT, num_pages INTEGER NOT NULL)",
    "CREATE TABLE requests (request_no INTEGER NOT NULL, request_id VARCHAR NOT NULL, "
    "transfer_id UBIGINT, tenant_id VARCHAR)",
)
# What the narrow row holds; the other non-null event columns are listed by Encoded.left_out.
NARROW_SOURCES = frozenset(
    {
        "producer_id",
        "batch_no",
        "schema_version",
        "seq",
        "kind",
        "wall_ns",
        "mono_ns",
        "request_id",
        "transfer_id",
        "tenant_id",
        "purpose",
        "free_reason",
        "source",
        "token_start",
        "token_end",
        "num_pages",
        "num_dst_pages",
    }
)


class Sink(Protocol):
    """What every ingest method offers: one DuckDB file at ``path``, fed batch ``i`` after batch."""

    name: str
    path: str

    def append(self, i: int, batch: pa.Table, pid: int) -> None: ...

    def checkpoint(self) -> None: ...

    def policy_checkpoints(self) -> tuple[int, float]: ...

    def close(self) -> None: ...


class KvtrailSink:
    """kvtrail itself: ``AuditStore.append`` (validation, run encoding, hash chain), default checkpoint policy."""

    name = "kvtrail"

    def __init__(self, path: str, policy: CheckpointPolicy = DEFAULT_CHECKPOINT) -> None:
        self.path = path
        self.store = AuditStore(path, checkpoint=policy)

    def policy_checkpoints(self) -> tuple[int, float]:
        return self.store.checkpoints, self.store.checkpoint_s

    def append(self, i: int, batch: pa.Table, pid: int) -> None:
        self.store.append(batch)

    def checkpoint(self) -> None:
        self.store.checkpoint()

    def close(self) -> None:
        self.store.close()


_SNAPSHOT_CODES = frozenset(KIND_CODES[k] for k in ("pages_allocated", "pages_freed", "kv_written", "kv_read"))


def recorder_items(batch: pa.Table) -> tuple[list[tuple], int]:
    """A batch as the recorder's buffer holds it: ``(code, seq, mono_ns, req, pages, dst, payload)`` per
    event (the page kinds' pages as the recorder snapshots an ndarray: its bytes, its dtype in the dst
    slot; the transfer kinds' as arrays), and the wall-minus-monotonic offset."""
    cols = {
        c: batch.column(c).to_pylist()
        for c in batch.column_names
        if batch.column(c).null_count < batch.num_rows and c not in ("pages", "dst_pages")
    }
    flat = pc.list_flatten(batch.column("pages")).to_numpy(zero_copy_only=False)
    lengths = pc.fill_null(pc.list_value_length(batch.column("pages")), 0).to_numpy(zero_copy_only=False)
    page_lists = np.split(flat, np.cumsum(lengths)[:-1])
    has_pages = batch.column("pages").is_valid().to_numpy(zero_copy_only=False)
    none = [None] * batch.num_rows
    items = []
    for i in range(batch.num_rows):
        code = KIND_CODES[cols["kind"][i]]
        rid = cols.get("request_id", none)[i]
        req = (
            None
            if rid is None
            else RequestRef(
                rid, cols.get("transfer_id", none)[i], cols.get("tenant_id", none)[i], cols.get("api_key_id", none)[i]
            )
        )
        payload = tuple(cols.get(name, none)[i] for name in PAYLOAD_LAYOUT_BY_CODE[code])
        pages: object = page_lists[i] if has_pages[i] else None
        dst: object = None
        if has_pages[i] and code in _SNAPSHOT_CODES:  # as the recorder snapshots a 1-D ndarray
            pages, dst = page_lists[i].tobytes(), page_lists[i].dtype
        items.append((code, cols["seq"][i], cols["mono_ns"][i], req, pages, dst, payload))
    return items, int(batch.column("wall_ns")[0].as_py()) - int(batch.column("mono_ns")[0].as_py())


class RecorderSink(KvtrailSink):
    """The recorder's path: its buffered tuples (built before timing) through the writer's ``build_batch``
    into ``AuditStore.append``, as the writer thread commits them."""

    name = "recorder"

    def __init__(
        self,
        path: str,
        items: list[tuple[list[tuple], int]],
        producer: Producer,
        policy: CheckpointPolicy = DEFAULT_CHECKPOINT,
    ) -> None:
        super().__init__(path, policy)
        self.items = items
        self.producer = producer

    def append(self, i: int, batch: pa.Table, pid: int) -> None:
        items, offset = self.items[i]
        self.store.append(build_batch(self.producer, items, offset))


class KvtrailWalSink(KvtrailSink):
    """kvtrail with the WAL left to grow to 256 MB and no time bound: the cost baseline of the policy."""

    name = "kv-wal"

    def __init__(self, path: str, policy: CheckpointPolicy = UNBOUNDED_WAL) -> None:
        super().__init__(path, policy)


class _DuckSink:
    """A plain DuckDB file, rows inserted via Arrow, no validation, no chain.

    It runs with the settings AuditStore gives its connection (insertion order not kept, so inserts
    run on every core; the WAL checkpointed at 256 MB, not DuckDB's 16 MB), so that the comparison
    is of the work, not of the settings.
    """

    name = ""
    ddl: tuple[str, ...] = ()

    def __init__(self, path: str) -> None:
        self.path = path
        self.con = duckdb.connect(path)
        self.con.execute("SET preserve_insertion_order = false")
        self.con.execute(f"SET wal_autocheckpoint = '{UNBOUNDED_WAL.max_wal_bytes}B'")
        for stmt in self.ddl:
            self.con.execute(stmt)

    def _insert(self, table: str, rows: pa.Table, columns: str = "*") -> None:
        self.con.register("_rows", rows)
        try:
            cols = "" if columns == "*" else f" ({columns})"
            self.con.execute(f"INSERT INTO {table}{cols} SELECT {columns} FROM _rows")
        finally:
            self.con.unregister("_rows")

    def checkpoint(self) -> None:
        self.con.execute("CHECKPOINT")

    def policy_checkpoints(self) -> tuple[int, float]:
        return 0, 0.0

    def close(self) -> None:
        self.con.close()


class NaiveSink(_DuckSink):
    """One row per page: the layout a first attempt would use."""

    name = "naive"
    ddl = (
        "CREATE TABLE page_rows (producer_id BIGINT NOT NULL, seq UBIGINT NOT NULL, pos INTEGER NOT NULL, "
        "page_id INTEGER NOT NULL)",
    )

    def append(self, i: int, batch: pa.Table, pid: int) -> None:
        col = batch.column("pages")
        lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False)
        flat = pc.list_flatten(col).to_numpy(zero_copy_only=False)
        starts = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        seq = batch.column("seq").to_numpy()
        pos = np.arange(flat.size, dtype=np.int64) - np.repeat(starts, lengths)
        self._insert(
            "page_rows",
            pa.table(
                {
                    "producer_id": pa.array(np.full(flat.size, pid, np.int64)),
                    "seq": pa.array(np.repeat(seq, lengths)),
                    "pos": pa.array(pos.astype(np.int32)),
                    "page_id": pa.array(flat),
                }
            ),
        )


class ListSink(_DuckSink):
    """One row per event with the page list as a plain INTEGER[] column (no run encoding)."""

    name = "list"
    ddl = ("CREATE TABLE event_pages (producer_id BIGINT NOT NULL, seq UBIGINT NOT NULL, pages INTEGER[])",)

    def append(self, i: int, batch: pa.Table, pid: int) -> None:
        self._insert(
            "event_pages",
            pa.table(
                {
                    "producer_id": pa.array(np.full(batch.num_rows, pid, np.int64)),
                    "seq": batch.column("seq"),
                    "pages": batch.column("pages"),
                }
            ),
        )


class Encoded:
    """Per batch, the rows kvtrail's store wrote (wide events, page_runs) and their narrow form, built once."""

    def __init__(self, store_path: str, num_batches: int) -> None:
        con = duckdb.connect(store_path, read_only=True)
        self.wide: list[tuple[pa.Table, str]] = []  # (rows, the columns inserted: those not all null)
        self.kinds: list[list[tuple[str, pa.Table, str]]] = []  # per batch: (kind table, rows, columns)
        self.runs: list[pa.Table] = []
        self.narrow: list[tuple[pa.Table, pa.Table]] = []  # (events, requests first seen in the batch)
        seen: dict[str, int] = {}
        left_out: set[str] = set()
        numbered = -1  # the highest request number the batches so far used
        for b in range(num_batches):
            ev = (
                con.sql("SELECT * FROM events WHERE batch_no = ? ORDER BY seq", params=[b])
                .to_arrow_table()
                .combine_chunks()
            )
            used = [c for c in ev.column_names if ev.column(c).null_count < ev.num_rows]
            left_out.update(c for c in used if c not in NARROW_SOURCES)
            self.wide.append((ev.select(used), ", ".join(used)))
            rows, numbered = _stored(con, b, numbered)
            self.kinds.append(rows)
            self.runs.append(
                con.sql(f"SELECT {RUN_COLUMNS} FROM page_runs WHERE batch_no = ? ORDER BY seq, list, pos", params=[b])
                .to_arrow_table()
                .combine_chunks()
            )
            self.narrow.append(_narrow(ev, seen))
        con.close()
        self.left_out = sorted(left_out)


def _stored(con: duckdb.DuckDBPyConnection, b: int, numbered: int) -> tuple[list[tuple[str, pa.Table, str]], int]:
    """Batch ``b``'s rows as AuditStore wrote them: per kind table its non-null columns, and first the
    request dictionary's rows new in the batch (numbers above ``numbered``). Returns them and the
    highest number the batch uses."""
    out = []
    top = numbered
    for kind in KIND_NAMES:
        table = table_name(kind)
        part = con.sql(f"SELECT * FROM {table} WHERE batch_no = ? ORDER BY seq", params=[b]).to_arrow_table()
        if not part.num_rows:
            continue
        part = part.combine_chunks()
        used = [c for c in part.column_names if part.column(c).null_count < part.num_rows]
        out.append((table, part.select(used), ", ".join(used)))
        if "request_no" in used:
            top = max(top, int(pc.max(part.column("request_no")).as_py()))
    new = (
        con.sql(
            f"SELECT * FROM {REQUESTS_TABLE} WHERE request_no > ? AND request_no <= ? ORDER BY request_no",
            params=[numbered, top],
        )
        .to_arrow_table()
        .combine_chunks()
    )
    if new.num_rows:
        out.insert(0, (REQUESTS_TABLE, new, ", ".join(new.column_names)))
    return out, top


def _narrow(ev: pa.Table, seen: dict[str, int]) -> tuple[pa.Table, pa.Table]:
    """The narrow events of one batch and the requests it names first (``seen`` numbers request ids)."""
    rid = ev.column("request_id").to_pylist()
    new_rows = []
    request_no = np.full(len(rid), -1, np.int64)
    for k, r in enumerate(rid):  # untimed: this is the encoding a producer would have done
        if r is None:
            continue
        if r not in seen:
            seen[r] = len(seen)
            new_rows.append(k)
        request_no[k] = seen[r]
    code = pc.coalesce(
        *(
            pc.index_in(ev.column(c), value_set=pa.array(choices))
            for c, choices in (("purpose", ALLOC_PURPOSES), ("free_reason", FREE_REASONS), ("source", WRITE_SOURCES))
        )
    )
    events = pa.table(
        {
            "producer_id": ev.column("producer_id"),
            "seq": ev.column("seq"),
            "kind": pc.index_in(ev.column("kind"), value_set=pa.array(KIND_NAMES)).cast(pa.uint8()),
            "wall_ns": ev.column("wall_ns"),
            "mono_ns": ev.column("mono_ns"),
            "request_no": pa.array(request_no, mask=request_no < 0).cast(pa.int32()),
            "code": code.cast(pa.uint8()),
            "token_start": ev.column("token_start"),
            "token_end": ev.column("token_end"),
            "num_pages": ev.column("num_pages"),
        }
    )
    take = pa.array(new_rows, pa.int64())
    requests = pa.table(
        {
            "request_no": pa.array([seen[rid[k]] for k in new_rows], pa.int32()),
            "request_id": ev.column("request_id").take(take),
            "transfer_id": ev.column("transfer_id").take(take),
            "tenant_id": ev.column("tenant_id").take(take),
        }
    )
    return events, requests


_RUNS_DDL = tuple(st for st in schema_ddl() if st.startswith("CREATE TABLE IF NOT EXISTS page_runs"))
_KIND_DDL = tuple(st for st in schema_ddl() if st.startswith("CREATE TABLE IF NOT EXISTS events_"))
assert len(_RUNS_DDL) == 1 and len(_KIND_DDL) == len(KIND_NAMES) + 1, (
    "schema_ddl makes page_runs, a table per kind and the request dictionary"
)


class LimitKindsSink(_DuckSink):
    """The rows kvtrail writes, already encoded and split by kind, appended into today's tables and page_runs."""

    name = "limit-kinds"
    ddl = _KIND_DDL + _RUNS_DDL

    def __init__(self, path: str, encoded: Encoded) -> None:
        super().__init__(path)
        self.encoded = encoded

    def append(self, i: int, batch: pa.Table, pid: int) -> None:
        self.con.begin()
        for table, rows, cols in self.encoded.kinds[i]:
            self._insert(table, rows, cols)
        self._insert("page_runs", self.encoded.runs[i], RUN_COLUMNS)
        self.con.commit()


class LimitWideSink(_DuckSink):
    """The same rows into store format 1's one wide events table (the layout before the kind tables)."""

    name = "limit-wide"
    ddl = (
        "CREATE TABLE events (" + ", ".join(f"{f.name} {column_type(f.name)}" for f in EVENTS_SCHEMA) + ")",
        *_RUNS_DDL,
    )

    def __init__(self, path: str, encoded: Encoded) -> None:
        super().__init__(path)
        self.encoded = encoded

    def append(self, i: int, batch: pa.Table, pid: int) -> None:
        rows, cols = self.encoded.wide[i]
        self.con.begin()
        self._insert("events", rows, cols)
        self._insert("page_runs", self.encoded.runs[i], RUN_COLUMNS)
        self.con.commit()


class LimitNarrowSink(_DuckSink):
    """The same information in the narrowest tables: 10-column events, requests once, page_runs."""

    name = "limit-narrow"
    ddl = NARROW_DDL + _RUNS_DDL

    def __init__(self, path: str, encoded: Encoded) -> None:
        super().__init__(path)
        self.encoded = encoded

    def append(self, i: int, batch: pa.Table, pid: int) -> None:
        events, requests = self.encoded.narrow[i]
        self.con.begin()
        self._insert("events", events)
        self._insert("requests", requests)
        self._insert("page_runs", self.encoded.runs[i], RUN_COLUMNS)
        self.con.commit()
