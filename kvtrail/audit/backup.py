"""``kvtrail audit backup``: a consistent single-file copy of a live or crashed store.

A store's committed data may sit in ``<db>.wal`` until a checkpoint, so copying ``<db>`` alone can
lose it. The backup copies both files as they are (no DuckDB lock needed, so a store another
process is writing can be copied too), opens the copy so that DuckDB replays the WAL, checkpoints
it into one file, and recomputes its chain before moving it into place.

Against a live writer: DuckDB only appends to the WAL between checkpoints, and a torn last entry is
dropped on replay, so the WAL copy is a prefix of committed batches. A checkpoint rewrites the main
file's header and then removes the WAL; if the header changed while the two files were copied, the
copy is taken again.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvtrail.audit.chain import SignatureChecker
from kvtrail.audit.store import fetch_row
from kvtrail.audit.storefile import check_store, connect, require_file, wal_path
from kvtrail.audit.verify import VerifyReport, verify_store
from kvtrail.errors import StoreError

# DuckDB's file header and its two alternating database headers: a completed checkpoint rewrites one.
HEADER_BYTES = 3 * 4096
MAX_ATTEMPTS = 5


@dataclass(frozen=True)
class BackupResult:
    """The copy written by :func:`backup_store`, what it holds and its chain check."""

    path: Path
    num_bytes: int
    producers: int
    batches: int
    events: int
    attempts: int  # copies taken (more than one when the writer checkpointed meanwhile)
    report: VerifyReport


def _head(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(HEADER_BYTES)


def _snapshot(src: Path, dst: Path) -> bool:
    """Copy ``src`` and its WAL to ``dst``; False if a checkpoint completed meanwhile (copy again)."""
    before = _head(src)
    shutil.copyfile(src, dst)
    wal_path(dst).unlink(missing_ok=True)
    try:
        shutil.copyfile(wal_path(src), wal_path(dst))
    except FileNotFoundError:  # nothing un-checkpointed (or a checkpoint just removed it: the header tells)
        pass
    return _head(src) == before


def _take_copy(src: Path, dst: Path) -> int:
    for attempt in range(1, MAX_ATTEMPTS + 1):
        if _snapshot(src, dst):
            return attempt
        time.sleep(0.05 * attempt)
    raise StoreError(
        f"store {src} was checkpointed during each of {MAX_ATTEMPTS} copies; try again, or stop its writer first"
    )


class _StaleWal(StoreError):
    """The copied WAL is not the main file's: DuckDB left it unreplayed (a checkpoint raced the copy)."""


def _seal(path: Path, source: Path) -> tuple[int, int, int]:
    """Replay the copied WAL into the copy's main file and check it is a kvtrail store; its row counts."""
    con = connect(path, read_only=False)
    try:
        check_store(con, source)
        counts = fetch_row(
            con,
            "SELECT (SELECT count(*) FROM producers), (SELECT count(*) FROM batches), (SELECT count(*) FROM events)",
        )
        con.execute("CHECKPOINT")
    finally:
        con.close()
    left = wal_path(path)
    if left.exists():  # DuckDB may leave an empty one behind when the copied WAL held only its header
        if left.stat().st_size:
            raise _StaleWal(f"the copy of {source} still has a WAL after its checkpoint")
        left.unlink()
    return int(counts[0]), int(counts[1]), int(counts[2])


def backup_store(
    db: str | Path, to: str | Path, *, force: bool = False, checker: SignatureChecker | None = None, progress=None
) -> BackupResult:
    """Write a single-file copy of the store at ``db`` (its main file plus its WAL) to ``to``.

    Refuses (StoreError) an existing ``to`` unless ``force``, a target that is the store itself, and
    a source that is not a kvtrail store. The copy's chain is recomputed (``checker``: also its
    signatures; ``progress(n)`` per batch checked); the copy is kept even if that fails, as evidence.
    """
    src, to = require_file(db), Path(to)
    if to.exists() and to.resolve() == src.resolve():
        raise StoreError(f"--to: {to} is the store itself")
    for path in (to, wal_path(to)):
        if path.exists() and not force:
            raise StoreError(f"--to: {path} exists; --force replaces it")
        if path.is_dir():
            raise StoreError(f"--to: {path} is a directory")
    to.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{to.name}.", suffix=".partial", dir=to.parent))
    try:
        tmp = tmp_dir / "copy.duckdb"
        attempts = 0
        for retry in range(MAX_ATTEMPTS):
            attempts += _take_copy(src, tmp)
            try:
                producers, batches, events = _seal(tmp, src)
                break
            except _StaleWal:  # the WAL copied belongs to another checkpoint than the file: copy both again
                if retry == MAX_ATTEMPTS - 1:
                    raise
                for p in (tmp, wal_path(tmp)):
                    p.unlink(missing_ok=True)
        report = verify_store(tmp, checker=checker, progress=progress)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        wal_path(to).unlink(missing_ok=True)  # a stale WAL next to the copy would be replayed into it
        os.replace(tmp, to)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return BackupResult(to, to.stat().st_size, producers, batches, events, attempts, report)
