"""A replay task reads only the events columns its replay uses (strings kept as dictionaries), the joins and the
reference engine every column; a column an older file lacks comes back as nulls of its type."""

from __future__ import annotations

import hashlib
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kvtrail.audit.lake.fs import LakeFS
from kvtrail.audit.layout import EVENTS_SCHEMA
from kvtrail.forensics.lake import task as lake_task
from kvtrail.forensics.lake.plan import plan_tasks
from kvtrail.forensics.lake.questions import open_lake
from kvtrail.forensics.lake.task import REPLAY_COLUMNS, PartitionTask, events_columns, read_tables
from kvtrail.forensics.policy import ForensicsPolicy
from tests.lake.conftest import BOUNDARY_NS


def _tasks(lake_dir: str, from_ns: int | None = None) -> list[PartitionTask]:
    with open_lake(lake_dir) as lk:
        return plan_tasks(lk.fs, lk.manifest, lk.con, from_ns, None, ForensicsPolicy(), None, need_joins=True)


def _plain(table: pa.Table) -> pa.Table:
    """``table`` with dictionary columns decoded (to compare values, not encodings)."""
    return pa.table(
        {
            n: c.cast(c.type.value_type) if pa.types.is_dictionary(c.type) else c
            for n, c in zip(table.column_names, table.columns)
        }
    )


def test_a_page_replay_reads_its_columns_alone_with_the_same_values(fleet_lake):
    tasks = [t for t in _tasks(fleet_lake) if t.mode == "pages"]
    assert tasks
    fs = LakeFS.open(fleet_lake)
    for t in tasks:
        cols = events_columns(t)
        assert cols == REPLAY_COLUMNS
        narrow = read_tables(fs, t, 1, events_columns=cols)
        full = read_tables(fs, t, 1)
        events = narrow["events"]
        assert set(events.column_names) == set(REPLAY_COLUMNS) < set(full["events"].column_names)
        assert pa.types.is_dictionary(events.schema.field("kind").type)  # a string column stays encoded
        assert _plain(events).select(list(REPLAY_COLUMNS)).equals(full["events"].select(list(REPLAY_COLUMNS)))
        for name in set(full) - {"events"}:  # the other tables whole
            assert narrow[name].equals(full[name])


def test_joins_and_the_reference_engine_read_every_column(fleet_lake, monkeypatch):
    tasks = _tasks(fleet_lake, BOUNDARY_NS)  # a window after the first hour: that hour's joins are replayed
    joins = [t for t in tasks if t.mode == "joins"]
    assert joins and all(events_columns(t) is None for t in joins)
    monkeypatch.setattr(lake_task, "fast_by_default", lambda: False)
    assert all(events_columns(t) is None for t in tasks)


def _with_older_file(fleet_lake, tmp_path, dropped: tuple[str, ...], keep_newer: bool):
    """A copy of the lake, one of its pages tasks, and that task's first events file as read. The task
    reads instead that file written again without the ``dropped`` columns (an older file; with
    ``keep_newer`` beside the file itself, after it)."""
    lake_dir = str(tmp_path / "lake")
    shutil.copytree(fleet_lake, lake_dir)
    fs = LakeFS.open(lake_dir)
    t = next(t for t in _tasks(lake_dir) if t.mode == "pages")
    files = dict(t.files)
    path, sha = files["events"][0]
    table = pq.read_table(pa.BufferReader(fs.read(path)))
    assert all(c in table.column_names for c in dropped)
    buf = pa.BufferOutputStream()
    pq.write_table(table.drop_columns(list(dropped)), buf)
    data = buf.getvalue().to_pybytes()
    older = "events/older-file.parquet"
    fs.write(older, data)
    files["events"] = ((older, hashlib.sha256(data).hexdigest()),) + (((path, sha),) if keep_newer else ())
    return fs, PartitionTask(**{**t.__dict__, "files": tuple(files.items())}), table


def test_a_column_an_older_file_lacks_is_null_of_its_type(fleet_lake, tmp_path):
    dropped = ("block_hashes", "page_digests")
    fs, t, old = _with_older_file(fleet_lake, tmp_path, dropped, keep_newer=False)

    events = read_tables(fs, t, 1, events_columns=REPLAY_COLUMNS)["events"]
    assert events.num_rows == old.num_rows
    for col in dropped:
        assert events.schema.field(col).type == EVENTS_SCHEMA.field(col).type
        assert events.column(col).null_count == events.num_rows
    kept = [c for c in REPLAY_COLUMNS if c not in dropped]
    assert _plain(events.select(kept)).equals(old.select(kept))


def test_an_older_file_beside_a_newer_one_reads_its_missing_strings_as_nulls(fleet_lake, tmp_path):
    # the newer file's string columns come as dictionaries; the older file's lack must not clash with them
    dropped = ("stage", "purpose")
    fs, t, new = _with_older_file(fleet_lake, tmp_path, dropped, keep_newer=True)

    events = read_tables(fs, t, 1, events_columns=REPLAY_COLUMNS)["events"]
    assert events.num_rows == 2 * new.num_rows
    for col in dropped:
        assert pa.types.is_dictionary(events.schema.field(col).type)
        values = _plain(events.select([col])).column(col)
        assert values.slice(0, new.num_rows).null_count == new.num_rows
        assert values.slice(new.num_rows).equals(new.column(col))


def test_a_file_altered_after_the_manifest_is_still_refused(fleet_lake, tmp_path):
    lake_dir = str(tmp_path / "lake")
    shutil.copytree(fleet_lake, lake_dir)
    fs = LakeFS.open(lake_dir)
    t = next(t for t in _tasks(lake_dir) if t.mode == "pages")
    path, _sha = dict(t.files)["events"][0]
    fs.write(path, fs.read(path) + b"\0")
    with pytest.raises(lake_task.LakeCoverageError, match="does not match the manifest"):
        read_tables(fs, t, 1, events_columns=REPLAY_COLUMNS)
