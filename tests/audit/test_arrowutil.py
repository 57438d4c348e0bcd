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


@pytest.mark.parametrize("type_", [pa.int8(), pa.int32(), pa.int64(), pa.uint64(), pa.bool_()])
def test_filled_and_valid_mask_agree_with_arrow_kernels(type_):
    """``filled`` is ``fill_null(...).to_numpy()`` and ``valid_mask`` is ``is_valid``, read from the buffers:
    sliced at every bit offset (bitmaps not byte-aligned), chunked, with and without nulls."""
    import pyarrow.compute as pc

    from kvtrail.audit.arrowutil import filled, valid_mask

    rng = np.random.default_rng(7)
    boolean = type_ == pa.bool_()
    fill = False if boolean else 5
    for n in (0, 1, 8, 9, 70):
        for null_share in (0.0, 0.4):
            values = rng.integers(0, 2 if boolean else 100, n).tolist()
            nulls = rng.random(n) < null_share
            arr = pa.array([None if z else (bool(v) if boolean else v) for v, z in zip(values, nulls)], type_)
            for offset in range(min(n, 10) + 1):
                part = arr.slice(offset)
                for col in (part, pa.chunked_array([part], type_), pa.chunked_array([part, arr], type_)):
                    want = pc.fill_null(col, pa.scalar(fill, type_)).to_numpy(zero_copy_only=False)
                    got = filled(col, fill)
                    assert got.dtype == want.dtype and got.tolist() == want.tolist()
                    assert valid_mask(col).tolist() == pc.is_valid(col).to_numpy(zero_copy_only=False).tolist()
    assert filled(pa.nulls(3), -1).tolist() == [-1, -1, -1]
    assert valid_mask(pa.nulls(2)).tolist() == [False, False]
    with pytest.raises(TypeError, match="not string"):
        filled(pa.array(["a"]), 0)
