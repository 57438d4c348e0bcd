"""A store written before a field existed: refused read-only with the way out, upgraded on a writable
open, and its chain still verifies (a field added later that is null throughout leaves a digest as it was)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from kvtrail.audit import chain
from kvtrail.audit.batch import from_dicts
from kvtrail.audit.events import ADDED_FIELDS, ADDED_KINDS, KIND_NAMES
from kvtrail.audit.layout import kind_columns, table_name
from kvtrail.audit.store import EVENTS_SCHEMA, AuditStore, connect_readonly
from kvtrail.audit.verify import verify_store
from kvtrail.cli import main
from kvtrail.errors import StoreError
from tests.conftest import event, producer


def _events(prod, seq):
    if seq == 0:
        return [event(0, "node_config", prod, pool_tokens=512, pool_pages=32, page_size=16, context_tokens=512)]
    return [
        event(
            seq,
            "pages_allocated",
            prod,
            request={"request_id": f"r{seq}", "tenant_id": "acme"},
            pages=[seq],
            purpose="prefill_extend",
        )
    ]


_ADDED_TABLES = tuple(table_name(k) for k in ADDED_KINDS)


def _added_columns():
    """(kind table, column) of every later field, as this kvtrail stores it."""
    return [(table_name(k), n) for k in KIND_NAMES for n in ADDED_FIELDS if n in kind_columns(k)]


def _old_store(path):
    """A store as an older kvtrail left it: batches without the later fields, and no such columns."""
    prod = producer("decode-0", "decode")
    with AuditStore(path) as store:
        store.append(from_dicts(_events(prod, 0)))
        store.append(from_dicts(_events(prod, 1)))
    import duckdb

    with duckdb.connect(str(path)) as con:
        con.execute("DROP VIEW IF EXISTS events_v")
        con.execute("DROP VIEW IF EXISTS events")
        for table, name in _added_columns():
            if table not in _ADDED_TABLES:
                con.execute(f"ALTER TABLE {table} DROP COLUMN {name}")
        for table in _ADDED_TABLES:  # kinds added later: their tables did not exist
            con.execute(f"DROP TABLE {table}")
    return prod


def test_a_null_later_field_leaves_the_digest_as_it_was():
    table = pa.table({f.name: pa.nulls(3, f.type) for f in EVENTS_SCHEMA})
    older = pa.schema([f for f in EVENTS_SCHEMA if f.name not in ADDED_FIELDS])
    runs = pa.table({"x": pa.array([1, 2], pa.int64())})
    with_field = chain.batch_digest(chain.GENESIS, (1, 2), table, EVENTS_SCHEMA, runs, runs.schema)
    without = chain.batch_digest(chain.GENESIS, (1, 2), table.select(older.names), older, runs, runs.schema)
    assert with_field == without
    # a value in the field does count
    filled = table.set_column(
        table.schema.get_field_index(ADDED_FIELDS[0]), ADDED_FIELDS[0], pa.array([1, None, None], pa.int64())
    )
    assert chain.batch_digest(chain.GENESIS, (1, 2), filled, EVENTS_SCHEMA, runs, runs.schema) != with_field


def test_an_older_store_is_refused_read_only_then_upgraded_and_still_verifies(tmp_path, capsys):
    db = tmp_path / "old.duckdb"
    prod = _old_store(db)
    with pytest.raises(StoreError, match="written by an older kvtrail .*kvtrail audit upgrade --db"):
        connect_readonly(db)
    assert main(["audit", "verify", "--db", str(db)]) == 2
    err = capsys.readouterr().err
    assert "older kvtrail" in err and all(f"{t} table" in err for t in _ADDED_TABLES)
    assert main(["audit", "upgrade", "--db", str(db)]) == 0
    assert f"added event field(s) {', '.join(ADDED_FIELDS)}" in capsys.readouterr().out
    assert main(["audit", "upgrade", "--db", str(db)]) == 0
    assert "already current" in capsys.readouterr().out
    with AuditStore(db) as store:  # and new batches with the field chain on
        store.append(from_dicts([event(2, "recorder_started", prod, flush_interval_ns=10**9)]))
    con = connect_readonly(db)
    report = verify_store(con)
    con.close()
    assert report.ok and report.batches_checked == 3, report.problems
