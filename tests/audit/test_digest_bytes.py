"""The chain digest reads Arrow buffers in place: it must hash exactly the bytes of the canonical form
(nulls filled, strings as lengths then bytes, lists as lengths then values), whatever the arrays look
like (sliced, chunked, nulls over data, empty). ``_reference`` spells that form out the plain way."""

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from kvtrail.audit import chain


def _reference(h, arr: pa.Array) -> None:
    n, nulls = len(arr), arr.null_count
    if n and nulls == n:
        h.update(b"N")
        return
    if nulls:
        h.update(b"V" + np.packbits(pc.is_valid(arr).to_numpy(zero_copy_only=False)).tobytes())
    else:
        h.update(b"A")
    t = arr.type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t):
        filled = pc.fill_null(arr, "" if not pa.types.is_binary(t) else b"").cast(pa.large_binary())
        values = filled.to_pylist()
        h.update(np.array([len(v) for v in values], dtype=np.int64).tobytes())
        h.update(b"".join(values))
    elif pa.types.is_list(t) or pa.types.is_large_list(t):
        lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        h.update(lengths.tobytes())
        _reference(h, pc.list_flatten(arr))
    elif pa.types.is_boolean(t):
        h.update(pc.fill_null(arr, False).to_numpy(zero_copy_only=False).astype(np.uint8).tobytes())
    else:
        h.update(pc.fill_null(arr, 0).to_numpy(zero_copy_only=False).tobytes())


def _both(arr: pa.Array) -> tuple[bytes, bytes]:
    fast, ref = hashlib.sha256(), hashlib.sha256()
    chain._column_bytes(fast, arr)
    _reference(ref, arr)
    return fast.digest(), ref.digest()


def _null_over_data() -> list[pa.Array]:
    """Arrays whose null slots still span bytes or list values (legal Arrow; pyarrow never builds them)."""
    validity = pa.py_buffer(np.packbits(np.array([1, 0, 1], bool), bitorder="little").tobytes())
    offsets = pa.py_buffer(np.array([0, 2, 5, 6], np.int32).tobytes())
    strings = pa.Array.from_buffers(pa.string(), 3, [validity, offsets, pa.py_buffer(b"abcdefgh")], null_count=1)
    lists = pa.ListArray.from_buffers(
        pa.list_(pa.int32()), 3, [validity, offsets], children=[pa.array(np.arange(6, dtype=np.int32))]
    )
    ints = pa.Array.from_buffers(
        pa.int64(), 3, [validity, pa.py_buffer(np.array([4, 99, 6], np.int64).tobytes())], null_count=1
    )
    return [strings, lists, ints]


def _validity_edges() -> list[pa.Array]:
    """Bitmaps read in place: slices starting on a byte and off it, a length not a multiple of 8, and set
    bits past the last row (Arrow leaves them undefined)."""
    values = [None if i % 3 == 0 else i for i in range(40)]
    ints = pa.array(values, pa.int64())
    junk = pa.py_buffer(bytes([0b11111010, 0xFF]))  # rows 0 and 2 null; bits past row 9 set
    tail = pa.Array.from_buffers(
        pa.int32(), 10, [junk, pa.py_buffer(np.arange(10, dtype=np.int32).tobytes())], null_count=2
    )
    strings = pa.array([None if i % 4 == 1 else f"s{i}" for i in range(30)], pa.string())
    return [ints, ints.slice(8, 13), ints.slice(16, 8), ints.slice(5, 20), tail, strings.slice(8, 11)]


CASES = [
    pa.array([1, None, 3, 2**40], pa.int64()),
    pa.array([0, 2**64 - 1, None], pa.uint64()),
    pa.array(np.arange(1000, dtype=np.int32)).slice(17, 400),
    pa.array(["req-1", None, "", "tenant-ü"], pa.string()),
    pa.array(["a" * 30, "b", None, "cc"], pa.string()).slice(1, 3),
    pa.array(["x", None, "yz"], pa.large_string()),
    pa.array([b"\x00\x01", None, b""], pa.binary()),
    pa.array([True, None, False]),
    pa.array([[1, 2, 3], None, [], [7]], pa.list_(pa.int32())),
    pa.array([[1, 2], [3, None], None, [5, 6, 7]], pa.list_(pa.int64())).slice(1, 3),
    pa.array([[1], [2, 3]], pa.list_(pa.uint64())),
    pa.array([], pa.int64()),
    pa.array([], pa.string()),
    pa.array([], pa.list_(pa.int32())),
    pa.nulls(5, pa.string()),
    pa.nulls(4, pa.list_(pa.int32())),
    *_null_over_data(),
    *_validity_edges(),
]


@pytest.mark.parametrize("arr", CASES, ids=[f"{i}-{a.type}" for i, a in enumerate(CASES)])
def test_the_in_place_digest_hashes_the_canonical_bytes(arr):
    fast, ref = _both(arr)
    assert fast == ref


def test_a_changed_value_changes_the_digest():
    base = pa.array(["r1", "r2", None], pa.string())
    assert _both(base)[0] != _both(pa.array(["r1", "r3", None], pa.string()))[0]
    assert _both(base)[0] != _both(pa.array(["r1", "r2", ""], pa.string()))[0]  # null vs empty: the bitmap
