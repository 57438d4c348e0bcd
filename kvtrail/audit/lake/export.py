"""``kvtrail lake export`` and ``kvtrail audit export``: a store's batches not yet in the lake, as Hive-partitioned
Parquet plus a manifest (:mod:`kvtrail.audit.lake.manifest`), the one layout of both.

Each export reads the store read-only (no writer holds it meanwhile), takes per producer the committed batches after the
last one the lake holds (and, with ``since_ns``, ending at or after it), writes their events and page runs
one file per (producer, partition), the batch headers and new producers, then the page-state checkpoints
of the nodes it touched, and last the next manifest (so a failed export leaves the lake as it was, plus
unlisted files the next verify names). Several stores export into one lake: a producer's batches are only
appended after the head the lake holds, and a store whose chain for that producer differs is refused.

A whole-store export (``whole_store=True``, what ``kvtrail audit export`` writes) goes into a lake with no
manifest yet and takes everything the store holds, so an import gives the store back: every producer,
the headers of pruned batches too, and the tables an incremental export leaves to each store (``meta``,
``prunes``, ``prune_batches``, ``legal_holds``), one file each.
"""

from __future__ import annotations

import base64
import hashlib
import io
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kvtrail import __version__
from kvtrail.audit.chain import Signer
from kvtrail.audit.events import PRODUCER_FIELDS
from kvtrail.audit.lake.catalog import STORE_TABLES, WHOLE_STORE_TABLES
from kvtrail.audit.lake.fs import LakeFS
from kvtrail.audit.lake.manifest import FileEntry, Manifest, read_manifest, write_manifest
from kvtrail.audit.lake.partition import HOUR_NS, Partition, check_name
from kvtrail.audit.store import connect_readonly, fetch_row
from kvtrail.audit.tlog import current_checkpoint
from kvtrail.errors import KvtrailError, StoreError

PRODUCER_NAMES = tuple(f.name for f in PRODUCER_FIELDS)
Progress = Callable[[str], None] | None


@dataclass(frozen=True)
class LakeExportResult:
    export_no: int
    batches: int
    events: int
    files: int  # files written, checkpoints and manifest included
    checkpoints: int
    page_runs: int = 0
    producers: int = 0  # producer rows written


def _parquet(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    return buf.getvalue()


def _pid_name(pid: int) -> str:
    return f"{pid & 0xFFFFFFFFFFFFFFFF:016x}"


class LakeWriter:
    """Writes files into the lake and records them in the manifest being built."""

    def __init__(self, lake: LakeFS, doc: Manifest):
        self.lake, self.doc, self.written = lake, doc, 0

    def put(self, rel: str, data: bytes, *, table: str, rows: int, **partition) -> None:
        self.lake.write(rel, data)
        self.doc.files[rel] = FileEntry(
            table, hashlib.sha256(data).hexdigest(), len(data), rows, self.doc.export_no, **partition
        )
        self.written += 1


def _new_batches(con: duckdb.DuckDBPyConnection, doc: Manifest, since_ns: int | None, whole: bool) -> pa.Table:
    if whole:  # pruned batches too: their headers (and the prune records) are what the store holds of them
        return con.sql("SELECT * FROM batches ORDER BY producer_id, batch_no").to_arrow_table()
    done = pa.table(
        {
            "producer_id": pa.array([int(k) for k in doc.exported_batches], pa.int64()),
            "done": pa.array(list(doc.exported_batches.values()), pa.int64()),
        }
    )
    con.register("_lake_done", done)
    try:
        return con.sql(
            "SELECT b.* FROM batches b LEFT JOIN _lake_done d USING (producer_id) "
            "WHERE b.pruned_by IS NULL AND b.batch_no > coalesce(d.done, -1) "
            "AND (d.done IS NOT NULL OR ? IS NULL OR b.max_wall_ns >= ?) "
            "ORDER BY producer_id, batch_no",
            params=[since_ns, since_ns],
        ).to_arrow_table()
    finally:
        con.unregister("_lake_done")


def _check_heads(con: duckdb.DuckDBPyConnection, doc: Manifest) -> None:
    """A producer the lake already holds must continue the lake's chain in this store."""
    for pid, head in doc.chain_heads.items():
        rows = con.execute(
            "SELECT digest FROM batches WHERE producer_id = ? AND batch_no = ?", [int(pid), head["batch_no"]]
        ).fetchall()
        if rows and bytes(rows[0][0]).hex() != head["digest"]:
            raise KvtrailError(
                f"--db: producer {pid} in the lake has another chain than in this store "
                f"(batch {head['batch_no']} differs); refusing to mix them"
            )


def _export_partitions(con, w: LakeWriter, pid: int, ident: dict, batch_nos: list[int]) -> tuple[int, int, set[int]]:
    """(events, page runs, hours) written of producer ``pid``'s batches ``batch_nos``."""
    con.register("_lake_b", pa.table({"batch_no": pa.array(batch_nos, pa.int64())}))
    try:
        hours = [
            r[0]
            for r in con.execute(
                "SELECT DISTINCT wall_ns // ? FROM events WHERE producer_id = ? AND batch_no IN (SELECT batch_no FROM "
                "_lake_b) ORDER BY 1",
                [HOUR_NS, pid],
            ).fetchall()
        ]
        events = runs_written = 0
        for hour in hours:
            part = Partition(ident["cluster"], ident["node"], int(hour))
            where = "producer_id = ? AND batch_no IN (SELECT batch_no FROM _lake_b) AND wall_ns >= ? AND wall_ns < ?"
            params = [pid, part.start_ns, part.end_ns]
            ev = con.sql(f"SELECT * FROM events WHERE {where} ORDER BY seq", params=params).to_arrow_table()
            runs = con.sql(
                f"SELECT r.* FROM page_runs r JOIN (SELECT producer_id, seq FROM events WHERE {where}) e "
                "USING (producer_id, seq) ORDER BY r.seq, r.list, r.pos",
                params=params,
            ).to_arrow_table()
            b = ev.column("batch_no").to_numpy()
            entry = {
                "cluster": part.cluster,
                "node": part.node,
                "hour": part.hour,
                "producer_id": pid,
                "batches": [int(b.min()), int(b.max())],
            }
            name = f"part-E{w.doc.export_no:06d}-P{_pid_name(pid)}.parquet"
            w.put(f"{part.path('events')}/{name}", _parquet(ev), table="events", rows=ev.num_rows, **entry)
            w.put(f"{part.path('page_runs')}/{name}", _parquet(runs), table="page_runs", rows=runs.num_rows, **entry)
            events += ev.num_rows
            runs_written += runs.num_rows
        return events, runs_written, {int(h) for h in hours}
    finally:
        con.unregister("_lake_b")


def _whole_store_tables(con: duckdb.DuckDBPyConnection, w: LakeWriter, tag: str, progress: Progress) -> None:
    for table in WHOLE_STORE_TABLES:
        if progress:
            progress(table)
        rows = con.sql(f"SELECT * FROM {table} ORDER BY {STORE_TABLES[table]}").to_arrow_table()
        if rows.num_rows:
            w.put(f"{table}/part-{tag}.parquet", _parquet(rows), table=table, rows=rows.num_rows)


def _check_complete(con: duckdb.DuckDBPyConnection, events: int, runs: int) -> None:
    """A whole-store export holds every event and page run: only one without its batch could be left out."""
    for table, written in (("events", events), ("page_runs", runs)):
        total = fetch_row(con, f"SELECT count(*) FROM {table}")[0]
        if written != total:
            raise StoreError(f"{table}: {total - written} rows have no batch or event to partition them by")


# checkpoints(con, lake, writer, node key, first hour with new events, producer ids) -> checkpoints written:
# the forensics' page-state pass (kvtrail.forensics.lake.checkpointer), run per node the export touched.
Checkpoints = Callable[[duckdb.DuckDBPyConnection, LakeFS, "LakeWriter", tuple[str, str], int, dict], int]


def export_lake(
    db: str | Path,
    url: str,
    *,
    since_ns: int | None = None,
    signer: Signer | None = None,
    checkpoints: Checkpoints | None = None,
    progress: Progress = None,
    whole_store: bool = False,
) -> LakeExportResult:
    """Export the batches of the store at ``db`` the lake at ``url`` does not hold yet (see the module doc).

    ``checkpoints`` writes the page-state checkpoints of each node touched (the forensics' pass; a lake
    without them cannot be judged per partition). ``whole_store``: everything the store holds, into a lake
    with no manifest yet."""
    if not Path(db).is_file():
        raise KvtrailError(f"--db: store not found: {db}")
    lake = LakeFS.open(url)
    current = read_manifest(lake)
    if whole_store and current.number:
        raise KvtrailError(f"lake {url} holds exports already; a whole-store export starts a lake")
    doc = current.next()
    doc.kvtrail_version = __version__
    doc.exported_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    w = LakeWriter(lake, doc)
    con = connect_readonly(db)
    try:
        _check_heads(con, doc)
        new = _new_batches(con, doc, since_ns, whole_store)
        # The store's transparency log as of this export (it covers every batch the export can take).
        tree = current_checkpoint(con)
        doc.tree_origin, doc.tree_size = tree.origin, tree.size
        doc.tree_root = base64.b64encode(tree.root).decode()
        prod = con.sql(
            f"SELECT producer_id, {', '.join(PRODUCER_NAMES)}, pool_pages, first_seen_ns FROM producers "
            "ORDER BY producer_id"
        ).to_arrow_table()
        idents = {r["producer_id"]: r for r in prod.to_pylist()}
        producer_ids = {tuple(r[n] for n in PRODUCER_NAMES): pid for pid, r in idents.items()}
        pids = sorted(set(new.column("producer_id").to_pylist()))
        fresh = sorted(idents) if whole_store else [pid for pid in pids if str(pid) not in doc.producers]
        for pid in fresh:
            check_name("cluster", idents[pid]["cluster"])
            check_name("node", idents[pid]["node"])
        tag = f"E{doc.export_no:06d}"
        if progress and whole_store:
            progress("producers")
        if fresh:
            rows = prod.filter(pa.compute.is_in(prod.column("producer_id"), value_set=pa.array(fresh, pa.int64())))
            w.put(f"producers/part-{tag}.parquet", _parquet(rows), table="producers", rows=rows.num_rows)
            for pid in fresh:
                doc.producers[str(pid)] = {n: idents[pid][n] for n in PRODUCER_NAMES}
        if progress and whole_store:
            progress("batches")
        if new.num_rows:
            w.put(f"batches/part-{tag}.parquet", _parquet(new), table="batches", rows=new.num_rows)
        events = runs = 0
        first_new: dict[tuple[str, str], int] = {}
        bno = new.column("batch_no").to_numpy()
        bpid = new.column("producer_id").to_numpy()
        for pid in pids:
            mine = bno[bpid == pid]
            if progress:
                progress(f"producer {pid}: {len(mine)} batches")
            n, r, hours = _export_partitions(con, w, pid, idents[pid], mine.tolist())
            events, runs = events + n, runs + r
            key = (idents[pid]["cluster"], idents[pid]["node"])
            if hours:
                first_new[key] = min(first_new.get(key, min(hours)), min(hours))
            if str(pid) not in doc.exported_batches and int(mine.min()) > 0:
                # --since left the producer's earlier batches out: its chain in the lake starts here
                k = int(np.flatnonzero((bpid == pid) & (bno == mine.min()))[0])
                doc.anchors[str(pid)] = {
                    "batch_no": int(mine.min()),
                    "prev_digest": bytes(new.column("prev_digest")[k].as_py()).hex(),
                }
            last = int(mine.max())
            digest = new.column("digest").to_pylist()[int(np.flatnonzero((bpid == pid) & (bno == last))[0])]
            doc.exported_batches[str(pid)] = last
            doc.chain_heads[str(pid)] = {"batch_no": last, "digest": bytes(digest).hex()}
        if whole_store:
            _check_complete(con, events, runs)
            fmt = con.execute("SELECT value FROM meta WHERE key = 'store_format'").fetchall()
            doc.store_format = fmt[0][0] if fmt else None
            _whole_store_tables(con, w, tag, progress)
        written = 0
        for key in sorted(first_new):
            if checkpoints is None:
                break
            if progress:
                progress(f"checkpoints {key[0]}/{key[1]}")
            written += checkpoints(con, lake, w, key, first_new[key], producer_ids)
    except duckdb.Error as exc:
        raise StoreError(f"lake export of {db} failed: {exc}") from None
    finally:
        con.close()
    if not w.written and current.number:
        return LakeExportResult(current.number, 0, 0, 0, 0)  # nothing new: no new manifest
    if progress and whole_store:
        progress("manifest")
    write_manifest(lake, doc, signer)
    return LakeExportResult(doc.export_no, new.num_rows, events, w.written + 1, written, runs, len(fresh))
