"""Export an audit store to Hive-partitioned Parquet, and import such an export back losslessly.

Layout of an export directory (the one fleet-scale queries read with ``hive_partitioning``)::

  events/date=YYYY-MM-DD/node=<node>/*.parquet      every column of ``events``
  page_runs/date=YYYY-MM-DD/node=<node>/*.parquet   ``page_runs``, partitioned like their event
  producers.parquet  batches.parquet  prunes.parquet  prune_batches.parquet  legal_holds.parquet  meta.parquet
  manifest.json      format version, kvtrail version, export time, row counts, chain head per producer

``date`` is the UTC date of the event's ``wall_ns`` and ``node`` its producer's node. The partition
values live only in the directory names; the files hold exactly the store's columns and types.

On import the target keeps its own ``meta`` rows (``store_format``, ``created_ns`` describe the
target file) and its own ``store_opens``; meta keys the target lacks are copied from the export.
Before anything is written, the import recomputes the chain of what it imports
(:func:`verify_export`) and refuses a tampered export.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import duckdb

from kvtrail import __version__
from kvtrail.audit.layout import insert_from
from kvtrail.audit.store import AuditStore, connect_readonly, fetch_row, schema_ddl
from kvtrail.audit.storefile import MIGRATABLE_FORMATS, STORE_FORMAT, connect, wal_path
from kvtrail.audit.tlog import FRONTIER_KEY, ORIGIN_KEY
from kvtrail.audit.verify import VerifyReport, verify_store
from kvtrail.errors import ChainError, StoreError

FORMAT_VERSION = 1
# Import order: producers first, so a duplicate producer is refused before any heavy reading.
TABLES = ("producers", "meta", "batches", "events", "page_runs", "prunes", "prune_batches", "legal_holds")
TABLE_KEYS = {
    "producers": "producer_id",
    "meta": "key",
    "batches": "producer_id, batch_no",
    "events": "producer_id, seq",
    "page_runs": "producer_id, seq, list, pos",
    "prunes": "prune_id",
    "prune_batches": "prune_id, producer_id, batch_no",
    "legal_holds": "hold_id",
}
_NODE_RE = re.compile(r"[A-Za-z0-9._-]+")
# What verify_store reads: a chain check of an export needs only these.
_CHAIN_TABLES = ("producers", "batches", "events", "page_runs", "prunes", "prune_batches")
# Integer arithmetic, not to_timestamp(): a double loses the nanoseconds that decide the day at midnight.
_DATE_SQL = "CAST(DATE '1970-01-01' + CAST(e.wall_ns // 86400000000000 AS INTEGER) AS VARCHAR)"

Progress = Callable[[str], None] | None


@dataclass(frozen=True)
class ExportResult:
    events: int
    page_runs: int
    batches: int
    producers: int
    files: int  # files written, manifest included


@dataclass(frozen=True)
class ImportResult:
    events: int
    page_runs: int
    batches: int
    producers: int


def _lit(path: Path) -> str:
    return "'" + str(path).replace("'", "''") + "'"


def _chain_heads(con: duckdb.DuckDBPyConnection, producer_ids: list[int] | None = None) -> dict[str, dict]:
    where = "TRUE" if producer_ids is None else "producer_id IN (SELECT unnest(?))"
    rows = con.execute(
        f"SELECT producer_id, batch_no, digest FROM batches WHERE {where} "
        "QUALIFY row_number() OVER (PARTITION BY producer_id ORDER BY batch_no DESC) = 1",
        None if producer_ids is None else [producer_ids],
    ).fetchall()
    return {str(pid): {"batch_no": no, "digest": bytes(d).hex()} for pid, no, d in rows}


# Partitioned tables: each row with the UTC date of its event and its producer's node.
_PARTITION_QUERIES = {
    "events": f"SELECT e.*, {_DATE_SQL} AS date, p.node AS node FROM events e "
    "JOIN producers p ON p.producer_id = e.producer_id ORDER BY e.producer_id, e.seq",
    "page_runs": f"SELECT r.*, {_DATE_SQL} AS date, p.node AS node FROM page_runs r "
    "JOIN events e ON e.producer_id = r.producer_id AND e.seq = r.seq "
    "JOIN producers p ON p.producer_id = r.producer_id ORDER BY r.producer_id, r.seq, r.list, r.pos",
}


def _copy_sql(table: str, out: Path) -> str:
    if table in _PARTITION_QUERIES:
        return f"COPY ({_PARTITION_QUERIES[table]}) TO {_lit(out / table)} (FORMAT parquet, PARTITION_BY (date, node))"
    query = f"SELECT * FROM {table} ORDER BY {TABLE_KEYS[table]}"
    return f"COPY ({query}) TO {_lit(out / f'{table}.parquet')} (FORMAT parquet)"


def export_parquet(db_path: str | Path, out_dir: str | Path, *, progress: Progress = None) -> ExportResult:
    """Write the store at ``db_path`` to ``out_dir`` as Hive-partitioned Parquet plus a manifest.

    The store is opened read-only and read in one snapshot. ``out_dir`` must not exist or be empty;
    files are written to a sibling temporary directory that is renamed into place when complete.
    ``progress`` is called with the name of each step. Raises StoreError.
    """
    db_path, out_dir = Path(db_path), Path(out_dir)
    if not db_path.is_file():
        raise StoreError(f"store not found: {db_path}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise StoreError(f"export directory {out_dir} exists and is not empty")
    con = connect_readonly(db_path)
    try:
        con.begin()
        for (node,) in con.execute("SELECT DISTINCT node FROM producers ORDER BY node").fetchall():
            if not _NODE_RE.fullmatch(node):
                raise StoreError(
                    f"node name {node!r} cannot be a partition directory "
                    "(only letters, digits, '.', '_' and '-' are allowed)"
                )
        counts = {t: fetch_row(con, f"SELECT count(*) FROM {t}")[0] for t in TABLES}
        fmt = con.execute("SELECT value FROM meta WHERE key = 'store_format'").fetchone()
        manifest = {
            "format_version": FORMAT_VERSION,
            "kvtrail_version": __version__,
            "store_format": fmt[0] if fmt else None,
            "exported_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "row_counts": counts,
            "chain_heads": _chain_heads(con),
        }
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
        try:
            for table in TABLES:
                if progress:
                    progress(table)
                written = fetch_row(con, _copy_sql(table, tmp))[0]
                if written != counts[table]:
                    # Only the joins of a partitioned table can drop rows: ones without their event or producer.
                    raise StoreError(
                        f"{table}: {counts[table] - written} rows have no event or producer to partition them by"
                    )
            if progress:
                progress("manifest")
            (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
            files = sum(1 for p in tmp.rglob("*") if p.is_file())
            if out_dir.exists():
                out_dir.rmdir()
            tmp.rename(out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    except duckdb.Error as exc:
        raise StoreError(f"export of {db_path} failed: {exc}") from None
    finally:
        con.close()
    return ExportResult(counts["events"], counts["page_runs"], counts["batches"], counts["producers"], files)


def _read_manifest(in_dir: Path) -> dict:
    path = in_dir / "manifest.json"
    if not path.is_file():
        raise StoreError(f"{in_dir} is not a kvtrail export: manifest.json is missing")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StoreError(f"{path}: unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise StoreError(f"{path}: unsupported export format version {version!r}; this kvtrail reads {FORMAT_VERSION}")
    # An export's files have the same columns whatever the layout of the store it came from.
    if manifest.get("store_format") not in (STORE_FORMAT, *MIGRATABLE_FORMATS):
        raise StoreError(
            f"{path}: export of store format {manifest.get('store_format')!r}; "
            f"this kvtrail reads {', '.join((*MIGRATABLE_FORMATS, STORE_FORMAT))}"
        )
    counts, heads = manifest.get("row_counts"), manifest.get("chain_heads")
    if not isinstance(counts, dict) or set(counts) != set(TABLES) or not isinstance(heads, dict):
        raise StoreError(
            f"{path}: row_counts must name exactly the tables {', '.join(TABLES)}, and chain_heads must be given"
        )
    return manifest


def _files(in_dir: Path, table: str) -> list[str]:
    if table in _PARTITION_QUERIES:
        return sorted(str(p) for p in (in_dir / table).glob("date=*/node=*/*.parquet"))
    path = in_dir / f"{table}.parquet"
    if not path.is_file():
        raise StoreError(f"{in_dir} is not a complete export: {path.name} is missing")
    return [str(path)]


def _check_columns(con: duckdb.DuckDBPyConnection, table: str, files: list[str], store_table: str) -> str:
    """The store table's column list, after checking that the export's files have exactly its columns and types."""
    # Partition values are path segments, not file columns: compare the files themselves to the table.
    file_cols = [
        (r[0], r[1])
        for r in con.execute("DESCRIBE SELECT * FROM read_parquet(?, hive_partitioning=false)", [files]).fetchall()
    ]
    table_cols = [(r[0], r[1]) for r in con.execute(f"DESCRIBE {store_table}").fetchall()]
    if file_cols != table_cols:
        diff = next((f"{a} vs {b}" for a, b in zip(file_cols, table_cols) if a != b), f"{file_cols} vs {table_cols}")
        raise StoreError(f"{table}: exported columns do not match the store's ({diff})")
    return ", ".join(name for name, _ in table_cols)


def verify_export(in_dir: str | Path, *, progress=None) -> VerifyReport:
    """Recompute the chain of an export (every link, every batch digest, the prune records) from its files,
    without writing anything. ``progress(n)`` is called as batches are checked. Raises StoreError for an
    export that cannot be read as one (bad manifest, missing files, wrong columns)."""
    in_dir = Path(in_dir)
    _read_manifest(in_dir)
    with duckdb.connect() as con:
        # Empty store tables in schema "ref" give each column's type; the checked tables are views over
        # the export's files (or the empty table where the export has none), so nothing is loaded twice.
        con.execute("CREATE SCHEMA ref")
        con.execute("USE memory.ref")
        for stmt in schema_ddl():
            con.execute(stmt)
        con.execute("USE memory.main")
        for table in _CHAIN_TABLES:
            files = _files(in_dir, table)
            if not files:
                con.execute(f"CREATE VIEW {table} AS SELECT * FROM ref.{table}")
                continue
            cols = _check_columns(con, table, files, f"ref.{table}")
            listed = ", ".join(_lit(Path(f)) for f in files)
            con.execute(f"CREATE VIEW {table} AS SELECT {cols} FROM read_parquet([{listed}], hive_partitioning=false)")
        try:
            return verify_store(con, progress=progress)
        except duckdb.Error as exc:
            raise StoreError(f"{in_dir}: cannot read the export to verify it: {str(exc).splitlines()[0]}") from None


def _import_table(con: duckdb.DuckDBPyConnection, in_dir: Path, table: str, expected) -> int:
    files = _files(in_dir, table)
    if not files:
        if expected != 0:
            raise StoreError(f"{table}: manifest says {expected} rows, the export holds none")
        return 0
    cols = _check_columns(con, table, files, table)
    # Columns are selected by name, which drops the partition columns (and any key=value segment of in_dir).
    src = (
        f"read_parquet(?, hive_partitioning={'true' if table in _PARTITION_QUERIES else 'false'}, "
        "hive_types_autocast=false)"
    )
    if table == "events":  # split by kind into the kind tables
        n = insert_from(con, f"(SELECT {cols} FROM {src} ORDER BY {TABLE_KEYS[table]})", [files])
    elif table == "meta":
        n = fetch_row(con, f"SELECT count(*) FROM {src}", [files])[0]
        con.execute(f"INSERT INTO meta SELECT {cols} FROM {src} WHERE key NOT IN (SELECT key FROM meta)", [files])
    else:
        n = fetch_row(
            con, f"INSERT INTO {table} ({cols}) SELECT {cols} FROM {src} ORDER BY {TABLE_KEYS[table]}", [files]
        )[0]
    if n != expected:
        raise StoreError(f"{table}: manifest says {expected} rows, the export holds {n}")
    return n


def _import_all(con: duckdb.DuckDBPyConnection, in_dir: Path, manifest: dict, progress: Progress) -> dict:
    counts = manifest["row_counts"]
    pids = [
        r[0]
        for r in con.execute(
            "SELECT producer_id FROM read_parquet(?, hive_partitioning=false)", [_files(in_dir, "producers")]
        ).fetchall()
    ]
    dup = con.execute(
        "SELECT producer_id, node, instance FROM producers WHERE producer_id IN (SELECT unnest(?)) "
        "ORDER BY producer_id LIMIT 1",
        [pids],
    ).fetchone()
    if dup:
        raise StoreError(f"target store already holds producer {dup[0]} (node {dup[1]}, instance {dup[2]})")
    for table in ("prunes", "legal_holds"):
        if counts[table] and fetch_row(con, f"SELECT count(*) FROM {table}")[0]:
            raise StoreError(f"target store already has {table} rows; retention records of two stores cannot be merged")
    fresh = fetch_row(con, "SELECT count(*) FROM batches")[0] == 0
    if fresh:  # a new store continues the exported log: its name and frontier come with meta
        con.execute("DELETE FROM meta WHERE key IN (?, ?)", [FRONTIER_KEY, ORIGIN_KEY])
    got = {}
    for table in TABLES:
        if progress:
            progress(table)
        got[table] = _import_table(con, in_dir, table, counts[table])
    if not fresh:
        # The imported batches take their places among the store's by commit time: its log is re-formed
        # (its earlier checkpoints no longer verify, docs/audit-log.md) and the cached frontier dropped.
        con.execute("DELETE FROM meta WHERE key = ?", [FRONTIER_KEY])
    heads, expected = _chain_heads(con, pids), manifest["chain_heads"]
    if heads != expected:
        pid = next(p for p in sorted(set(heads) | set(expected)) if heads.get(p) != expected.get(p))
        raise StoreError(f"chain head of producer {pid} differs from the manifest")
    return got


def import_parquet(
    in_dir: str | Path, db_path: str | Path, *, progress: Progress = None, verify: bool = True
) -> ImportResult:
    """Load an export made by :func:`export_parquet` into the store at ``db_path`` (created if missing).

    With ``verify`` (the default) the export's chain is recomputed first (:func:`verify_export`); a
    broken one raises ChainError naming its first problem, before the target is touched.
    Everything is inserted in one transaction: on any error nothing is written, and a store file
    this call created is removed again. Refuses (StoreError) a missing or unsupported manifest, row
    counts or chain heads that disagree with the files, a producer the target already holds, and
    retention records when the target already has its own. ``progress`` is called with each table name.
    """
    in_dir, db_path = Path(in_dir), Path(db_path)
    manifest = _read_manifest(in_dir)
    if verify:
        report = verify_export(in_dir)
        if not report.ok:
            raise ChainError(
                f"{in_dir}: the export's chain does not verify, nothing imported: first problem: {report.first_problem}"
            )
    created = not db_path.exists()
    AuditStore(db_path).close()
    done = False
    try:
        con = connect(db_path, read_only=False)
        try:
            con.begin()
            got = _import_all(con, in_dir, manifest, progress)
            con.commit()
            done = True
        finally:
            if not done:
                with contextlib.suppress(duckdb.Error):  # a failed commit has already rolled back
                    con.rollback()
            con.close()
    except duckdb.Error as exc:
        raise StoreError(f"import into {db_path} failed: {exc}") from None
    finally:
        if created and not done:
            for path in (db_path, wal_path(db_path)):
                path.unlink(missing_ok=True)
    return ImportResult(got["events"], got["page_runs"], got["batches"], got["producers"])
