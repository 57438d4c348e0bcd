"""Arrow helpers: list columns to and from (flat values, offsets), nullable schemas."""

import numpy as np
import pyarrow as pa
import pytest

from kvtrail.audit.arrowutil import (
    INT32_MAX,
    flat_list,
    list_array,
    list_from_items,
    list_lengths,
    nullable,
    offsets_from_lengths,
    pack_lists,
)
from kvtrail.audit.batch import BATCH_SCHEMA, NULLABLE_BATCH_SCHEMA


def test_offsets_from_lengths():
    assert offsets_from_lengths([2, 0, 3]).tolist() == [0, 2, 2, 5]
    assert offsets_from_lengths(np.array([], np.int32)).tolist() == [0]


def test_pack_lists_mixes_arrays_tuples_and_nulls():
    flat, offsets, absent = pack_lists([np.array([1, 2], np.int32), None, (3,), [], range(4, 6)], np.int64)
    assert flat.dtype == np.int64 and flat.tolist() == [1, 2, 3, 4, 5]
    assert offsets.tolist() == [0, 2, 2, 3, 3, 5]
    assert absent is not None and absent.tolist() == [False, True, False, False, False]
    flat, offsets, absent = pack_lists([np.array([7], np.int32), np.array([8, 9], np.int32)], np.int32)
    assert flat.tolist() == [7, 8, 9] and absent is None


def test_list_round_trip_keeps_nulls_and_empty_lists():
    items = [[1, 2], None, [], [3]]
    col = list_from_items(items, pa.int32(), np.int32)
    assert col.type == pa.list_(pa.int32()) and col.to_pylist() == items
    flat, offsets = flat_list(col, np.int64)
    assert flat.dtype == np.int64 and flat.tolist() == [1, 2, 3] and offsets.tolist() == [0, 2, 2, 2, 3]
    assert list_lengths(col).tolist() == [2, 0, 0, 1]
    again = list_array(flat, offsets, pa.int32(), np.array([x is None for x in items]))
    assert again.to_pylist() == items


def test_flat_list_reads_chunked_and_sliced_columns():
    col = pa.chunked_array(
        [pa.array([[1], None], pa.list_(pa.int32())), pa.array([[9, 9], [2, 3], [4]], pa.list_(pa.int32())).slice(1)]
    )
    flat, offsets = flat_list(col)
    assert flat.tolist() == [1, 2, 3, 4] and offsets.tolist() == [0, 1, 1, 3, 4]


def test_too_many_entries_for_32_bit_offsets_names_the_field():
    with pytest.raises(ValueError, match="dst_pages: a batch would hold more than 2"):
        list_array(np.zeros(1, np.int32), np.array([0, INT32_MAX + 1]), pa.int32(), field="dst_pages")


def test_nullable_schema():
    assert any(not f.nullable for f in BATCH_SCHEMA)
    assert all(f.nullable for f in NULLABLE_BATCH_SCHEMA)
    assert NULLABLE_BATCH_SCHEMA.names == BATCH_SCHEMA.names and NULLABLE_BATCH_SCHEMA.types == BATCH_SCHEMA.types
    assert nullable(pa.schema([pa.field("a", pa.int8(), nullable=False)])).field("a").nullable
