"""``kvtrail audit export`` / ``audit import``: a store as Parquet, and such an export back into a store, losslessly.

An export is a lake of one whole-store export (:func:`kvtrail.audit.lake.export.export_lake` with
``whole_store``; layout and manifest in docs/lake.md): ``events/`` and ``page_runs/`` partitioned
``cluster=/node=/date=/hour=``, one folder per other table, ``manifests/manifest-000001.json``. So
``kvtrail lake verify`` checks it and ``--lake`` asks it, and a lake that ``kvtrail lake export`` grew
imports the same way. An import also reads the exports of format 1 (:mod:`kvtrail.audit.lake.format1`:
``date=/node=`` partitions, ``manifest.json``). The partition values live only in the folder names; the
files hold exactly the store's columns and types.

On import the target keeps its own ``meta`` rows (``store_format``, ``created_ns`` describe the
target file) and its own ``store_opens``; meta keys the target lacks are copied from the export.
Before anything is written, the import recomputes the chain of what it imports and, for a lake, checks
every file against the SHA-256 its manifest lists (:func:`verify_export`), and refuses a tampered export.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import duckdb

from kvtrail.audit.lake import format1
from kvtrail.audit.lake.catalog import STORE_TABLES, select_list
from kvtrail.audit.lake.export import export_lake
from kvtrail.audit.lake.fs import LakeFS
from kvtrail.audit.lake.manifest import MANIFEST_DIR, LakeManifest, read_manifest
from kvtrail.audit.layout import insert_from
from kvtrail.audit.store import AuditStore, fetch_row, schema_ddl
from kvtrail.audit.storefile import connect, wal_path
from kvtrail.audit.tlog import FRONTIER_KEY, ORIGIN_KEY
from kvtrail.audit.verify import Problem, VerifyReport, verify_store
from kvtrail.errors import ChainError, KvtrailError, StoreError

TABLES = tuple(STORE_TABLES)
TABLE_KEYS = STORE_TABLES
# What verify_store reads: a chain check of an export needs only these.
_CHAIN_TABLES = ("producers", "batches", "events", "page_runs", "prunes", "prune_batches")

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


def export_parquet(
    db_path: str | Path, out_dir: str | Path, *, progress: Progress = None, checkpoints=None
) -> ExportResult:
    """Write the store at ``db_path`` to ``out_dir`` as a whole-store lake export (see the module doc).

    The store is opened read-only (no writer can hold it meanwhile). ``out_dir`` must not exist or be empty;
    files are written to a sibling temporary directory that is renamed into place when complete.
    ``progress`` is called with the name of each step; ``checkpoints`` is the lake export's page-state
    pass (:data:`kvtrail.audit.lake.export.Checkpoints`), without which the export is not judged per
    partition. Raises StoreError.
    """
    db_path, out_dir = Path(db_path), Path(out_dir)
    if not db_path.is_file():
        raise StoreError(f"store not found: {db_path}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise StoreError(f"export directory {out_dir} exists and is not empty")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    try:
        try:
            res = export_lake(db_path, str(tmp), whole_store=True, checkpoints=checkpoints, progress=progress)
        except ValueError as exc:  # a cluster or node name that cannot be a folder
            raise StoreError(str(exc)) from None
        if out_dir.exists():
            out_dir.rmdir()
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(res.events, res.page_runs, res.batches, res.producers, res.files)


@dataclass(frozen=True)
class _Source:
    """An export as an import reads it: files per table, the rows and chain heads its manifest promises,
    and for a lake its manifest (whose SHA-256s the verification checks)."""

    files: dict[str, list[str]]
    counts: dict[str, int]
    heads: dict[str, dict]
    lake: LakeManifest | None = None
    rel: dict[str, str] | None = None  # absolute path -> path in the lake


def _open_source(in_dir: Path) -> _Source:
    if format1.is_format1(in_dir):
        manifest = format1.read_manifest(in_dir)
        files = {t: format1.files(in_dir, t) for t in TABLES}
        return _Source(files, manifest["row_counts"], manifest["chain_heads"])
    if not (in_dir / MANIFEST_DIR).is_dir():
        raise StoreError(f"{in_dir} is not a kvtrail export: {format1.MANIFEST} is missing")
    lake = LakeFS.open(str(in_dir))
    try:
        m = read_manifest(lake)
    except KvtrailError as exc:
        raise StoreError(str(exc)) from None
    if not m.number:
        raise StoreError(f"{in_dir} is not a kvtrail export: {MANIFEST_DIR}/ holds no manifest")
    if m.doc.store_format is not None:
        format1.check_store_format(m.doc.store_format, f"{in_dir}/{MANIFEST_DIR}")
    present = set(lake.list())
    gone = sorted(p for p in m.files if p not in present)
    if gone:
        raise StoreError(f"{in_dir} is not a complete export: {gone[0]} is missing")
    rel = {lake.full(p): p for p in m.files}
    files = {t: [lake.full(p) for p in sorted(m.files_of(t))] for t in TABLES}
    counts = {t: sum(f.rows for f in m.files_of(t).values()) for t in TABLES}
    return _Source(files, counts, m.doc.chain_heads, m, rel)


def _check_columns(con: duckdb.DuckDBPyConnection, table: str, files: list[str], store_table: str) -> str:
    """The select list that reads the export's files as the store table, after checking that the files have
    exactly its columns and types; an export written before an event field was added (``ADDED_FIELDS``)
    lacks that column, read as null."""
    # Partition values are path segments, not file columns: compare the files themselves to the table.
    file_cols = [
        (r[0], r[1])
        for r in con.execute("DESCRIBE SELECT * FROM read_parquet(?, hive_partitioning=false)", [files]).fetchall()
    ]
    table_cols = [(r[0], r[1]) for r in con.execute(f"DESCRIBE {store_table}").fetchall()]
    return select_list(table, file_cols, table_cols)


def _altered(src: _Source) -> list[Problem]:
    """Files of a lake whose bytes are not the ones its manifest lists."""
    if src.lake is None or src.rel is None:
        return []
    out = []
    for path, rel in sorted(src.rel.items(), key=lambda kv: kv[1]):
        if hashlib.sha256(Path(path).read_bytes()).hexdigest() != src.lake.files[rel].sha256:
            out.append(Problem(None, None, None, f"altered file: {rel} (SHA-256 differs from the manifest)"))
    return out


def verify_export(in_dir: str | Path, *, progress=None) -> VerifyReport:
    """Recompute the chain of an export (every link, every batch digest, the prune records) from its files,
    and for a lake check every file against its manifest's SHA-256, without writing anything. ``progress(n)``
    is called as batches are checked. Raises StoreError for an export that cannot be read as one (bad
    manifest, missing files, wrong columns)."""
    in_dir = Path(in_dir)
    src = _open_source(in_dir)
    with duckdb.connect() as con:
        # Empty store tables in schema "ref" give each column's type; the checked tables are views over
        # the export's files (or the empty table where the export has none), so nothing is loaded twice.
        con.execute("CREATE SCHEMA ref")
        con.execute("USE memory.ref")
        for stmt in schema_ddl():
            con.execute(stmt)
        con.execute("USE memory.main")
        for table in _CHAIN_TABLES:
            files = src.files[table]
            if not files:
                con.execute(f"CREATE VIEW {table} AS SELECT * FROM ref.{table}")
                continue
            cols = _check_columns(con, table, files, f"ref.{table}")
            listed = ", ".join(_lit(Path(f)) for f in files)
            con.execute(f"CREATE VIEW {table} AS SELECT {cols} FROM read_parquet([{listed}], hive_partitioning=false)")
        try:
            report = verify_store(con, progress=progress)
        except duckdb.Error as exc:
            raise StoreError(f"{in_dir}: cannot read the export to verify it: {str(exc).splitlines()[0]}") from None
    report.problems.extend(_altered(src))  # after the chain's: a changed row is named by its batch first
    return report


def _import_table(con: duckdb.DuckDBPyConnection, files: list[str], table: str, expected) -> int:
    if not files:
        if expected != 0:
            raise StoreError(f"{table}: manifest says {expected} rows, the export holds none")
        return 0
    cols = _check_columns(con, table, files, table)
    # Partition values are folder names, never file columns (hive_partitioning=false); columns go by name.
    src = "read_parquet(?, hive_partitioning=false)"
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


def _import_all(con: duckdb.DuckDBPyConnection, src: _Source, progress: Progress) -> dict:
    counts, producer_files = src.counts, src.files["producers"]
    pids = (
        [
            r[0]
            for r in con.execute(
                "SELECT producer_id FROM read_parquet(?, hive_partitioning=false)", [producer_files]
            ).fetchall()
        ]
        if producer_files
        else []
    )
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
        got[table] = _import_table(con, src.files[table], table, counts[table])
    if not fresh:
        # The imported batches take their places among the store's by commit time: its log is re-formed
        # (its earlier checkpoints no longer verify, docs/audit-log.md) and the cached frontier dropped.
        con.execute("DELETE FROM meta WHERE key = ?", [FRONTIER_KEY])
    heads, expected = _chain_heads(con, pids), src.heads
    if heads != expected:
        pid = next(p for p in sorted(set(heads) | set(expected)) if heads.get(p) != expected.get(p))
        raise StoreError(f"chain head of producer {pid} differs from the manifest")
    return got


def import_parquet(
    in_dir: str | Path, db_path: str | Path, *, progress: Progress = None, verify: bool = True
) -> ImportResult:
    """Load an export (:func:`export_parquet`, a lake, or an export of format 1) into the store at ``db_path``
    (created if missing).

    With ``verify`` (the default) the export's chain is recomputed first (:func:`verify_export`); a
    broken one raises ChainError naming its first problem, before the target is touched.
    Everything is inserted in one transaction: on any error nothing is written, and a store file
    this call created is removed again. Refuses (StoreError) a missing or unsupported manifest, row
    counts or chain heads that disagree with the files, a producer the target already holds, and
    retention records when the target already has its own. ``progress`` is called with each table name.
    """
    in_dir, db_path = Path(in_dir), Path(db_path)
    src = _open_source(in_dir)
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
            got = _import_all(con, src, progress)
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
