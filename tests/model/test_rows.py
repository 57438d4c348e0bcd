"""The monitors make an event's scalars as Python values only for the rows their steps read
(``kvtrail.model.rows.Rows``): each row's values are the ones a whole column's ``to_pylist`` gives."""

from __future__ import annotations

import pyarrow as pa
import pytest

from kvtrail.model.rows import Rows

NAMES = ("kind", "node", "seq", "num_tokens", "is_last_chunk", "status")


def _table() -> pa.Table:
    kinds = pa.array(["pages_allocated", "transfer_sent", None, "pages_freed", "transfer_sent"]).dictionary_encode()
    first = pa.table(
        {
            "kind": kinds.slice(0, 3),
            "node": pa.array(["d0", "p0", "d0"]),
            "seq": pa.array([7, 8, 2**62], pa.int64()),
            "num_tokens": pa.array([None, 64, None], pa.int64()),
            "is_last_chunk": pa.array([None, True, None], pa.bool_()),
            "status": pa.nulls(3, pa.string()),
        }
    )
    second = pa.table(
        {
            "kind": kinds.slice(3, 2),
            "node": pa.array(["p1", None]),
            "seq": pa.array([9, 10], pa.int64()),
            "num_tokens": pa.array([None, 32], pa.int64()),
            "is_last_chunk": pa.array([None, False], pa.bool_()),
            "status": pa.nulls(2, pa.string()),
        }
    )
    return pa.concat_tables([first, second])  # two chunks per column, a dictionary column among them


def test_each_row_holds_the_values_of_the_whole_columns():
    table = _table()
    assert table.column("kind").num_chunks == 2
    whole = list(zip(*(table.column(n).to_pylist() for n in NAMES)))
    rows = Rows(table, NAMES)
    rows.fetch([4, 1, 1])  # some at once, one of them twice
    assert [rows[n] for n in range(table.num_rows)] == whole
    assert rows[2][2] == 2**62 and type(rows[1][2]) is int and rows[1][4] is True
    assert rows[4] == ("transfer_sent", None, 10, 32, False, None)


def test_a_column_the_table_leaves_out_reads_as_none():
    table = _table().drop_columns(["status", "num_tokens"])
    rows = Rows(table, NAMES)
    assert rows[1] == ("transfer_sent", "p0", 8, None, True, None)


def _long(n: int) -> pa.Table:
    return pa.table({"kind": pa.array(["kv_read"] * n), "seq": pa.array(range(n), pa.int64())})


def test_a_few_rows_are_made_alone_and_many_from_whole_columns():
    rows = Rows(_long(100), ("kind", "seq"))
    rows.fetch([3, 40, 97])
    assert set(rows._made) == {3, 40, 97} and rows._lists is None  # only those rows, through take
    rows.fetch(range(50, 70))  # a fifth of the table: whole columns are cheaper
    assert rows._lists is not None
    assert [rows[n] for n in (0, 3, 60, 99)] == [("kv_read", 0), ("kv_read", 3), ("kv_read", 60), ("kv_read", 99)]
    one_by_one = Rows(_long(1000), ("kind", "seq"))
    for n in range(40):  # rows no fetch asked for: past a few, whole columns too
        assert one_by_one[n] == ("kv_read", n)
    assert one_by_one._lists is not None


def test_a_row_out_of_range_is_refused():
    rows = Rows(_table(), NAMES)
    with pytest.raises(IndexError, match="row out of range"):
        rows.fetch([5])
    with pytest.raises(IndexError):
        rows[-1]
    with pytest.raises(IndexError):
        rows[5]
    assert len(Rows()) == 0


def test_pylist_gives_to_pylist_values_and_types_for_every_column_shape():
    """Whichever way a column is read (through its distinct values, through numpy, or Arrow's own), the
    values and Python types are ``to_pylist``'s (an unsigned 64-bit value past int64 included), at any
    slice offset."""
    from kvtrail.model.rows import pylist

    columns = [
        pa.array([None, 3, None, 2**63 + 5, 0, None, 7, 8, 9], pa.uint64()),
        pa.array([-1, None, 2, None, None, None, None, 5, None], pa.int32()),
        pa.array([True, None, False, None, True, True, None, False, True], pa.bool_()),
        pa.array([1, 2, 3, 4, 5, 6, 7, 8, 9], pa.int64()),
        pa.array(["a", None, "b", "a", None, "c", "a", "b", None]),
    ]
    for col in columns:
        for offset in range(len(col)):
            part = col.slice(offset)
            got, want = pylist(part), part.to_pylist()
            assert got == want and [type(v) for v in got] == [type(v) for v in want]
