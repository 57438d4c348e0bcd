"""Arrow helpers every batch builder shares: nullable schemas and list columns as (flat values, offsets).

Page lists travel as Arrow list columns. Builders hold them as per-row arrays, readers want them as
one flat array plus offsets (list ``i`` is ``flat[offsets[i]:offsets[i + 1]]``, a null list counts
as empty). These helpers do both directions in a few C-level passes, never per page in Python.
"""

from __future__ import annotations

from itertools import chain, compress, repeat
from operator import is_
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

INT32_MAX = 2**31 - 1


def nullable(schema: pa.Schema) -> pa.Schema:
    """``schema`` with every field nullable: batches are built loose, validation decides what is required."""
    return pa.schema([f.with_nullable(True) for f in schema])


def offsets_from_lengths(lengths: np.ndarray | Sequence[int]) -> np.ndarray:
    """int64 offsets (one more than there are lists, starting at 0) from per-list lengths."""
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def pack_lists(items: Sequence, dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Per-row lists (ndarray, tuple, list or None) as ``(flat, offsets, absent)``.

    ``flat`` has ``dtype``; ``absent`` marks the None rows, and is None when no row is None.
    """
    n = len(items)
    # Per-row work runs as C-level iterators (map, compress): no Python bytecode per row.
    absent = np.fromiter(map(is_, items, repeat(None)), dtype=bool, count=n)
    num_absent = int(absent.sum())
    if num_absent:
        lengths = np.zeros(n, dtype=np.int64)
        lengths[~absent] = np.fromiter(
            map(len, compress(items, (~absent).tolist())), dtype=np.int64, count=n - num_absent
        )
    else:
        lengths = np.fromiter(map(len, items), dtype=np.int64, count=n)
    offsets = offsets_from_lengths(lengths)
    present = list(compress(items, (lengths > 0).tolist()))
    if not present:
        flat = np.empty(0, dtype=dtype)
    elif set(map(type, present)) == {np.ndarray}:
        flat = np.concatenate(present).astype(dtype, copy=False)
    else:
        flat = np.fromiter(chain.from_iterable(present), dtype=dtype, count=int(offsets[-1]))
    return flat, offsets, absent if num_absent else None


def list_array(
    flat: np.ndarray,
    offsets: np.ndarray,
    value_type: pa.DataType,
    absent: np.ndarray | None = None,
    *,
    field: str = "pages",
) -> pa.ListArray:
    """An Arrow list column from flat values and int64 offsets; ``absent`` (bool per row) marks null lists.

    Raises ValueError naming ``field`` when the lists hold more entries than 32-bit offsets address.
    """
    if len(offsets) and int(offsets[-1]) > INT32_MAX:
        raise ValueError(f"{field}: a batch would hold more than 2**31 - 1 list entries")
    return pa.ListArray.from_arrays(
        pa.array(np.asarray(offsets).astype(np.int32)),
        pa.array(flat, value_type),
        mask=None if absent is None else pa.array(absent),
    )


def list_from_items(items: Sequence, value_type: pa.DataType, dtype, *, field: str = "pages") -> pa.ListArray:
    """An Arrow list column from per-row lists (ndarray, tuple, list or None for a null list)."""
    flat, offsets, absent = pack_lists(items, dtype)
    return list_array(flat, offsets, value_type, absent, field=field)


def _one_chunk(col: pa.Array | pa.ChunkedArray) -> pa.Array:
    """The column as one array: a single chunk read in place (``combine_chunks`` would copy it)."""
    if isinstance(col, pa.ChunkedArray):
        return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    return col


def _bits(buf: pa.Buffer | None, offset: int, n: int) -> np.ndarray:
    """``n`` bits of an Arrow bitmap from bit ``offset``, as bools (a missing bitmap: all set)."""
    if buf is None:
        return np.ones(n, bool)
    start, skip = divmod(offset, 8)
    raw = np.frombuffer(buf, np.uint8, count=(skip + n + 7) // 8, offset=start)
    return np.unpackbits(raw, count=skip + n, bitorder="little")[skip:].view(bool)


def valid_mask(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Per row, whether it is not null (``is_valid`` read from the validity bitmap, without a kernel)."""
    arr = _one_chunk(col)
    if pa.types.is_null(arr.type):
        return np.zeros(len(arr), bool)
    if not arr.null_count:
        return np.ones(len(arr), bool)
    return _bits(arr.buffers()[0], arr.offset, len(arr))


def filled(col: pa.Array | pa.ChunkedArray, value) -> np.ndarray:
    """A boolean or integer column as numpy, nulls as ``value``: what ``fill_null(col, value).to_numpy()``
    gives, read from the buffers in place (the kernel costs ~0.1 ms a call on a commit of a few thousand
    rows, the judge makes dozens of these calls per commit). Read-only where it is a view of the column."""
    arr = _one_chunk(col)
    n = len(arr)
    if pa.types.is_null(arr.type):
        return np.full(n, value)
    if pa.types.is_boolean(arr.type):
        out = _bits(arr.buffers()[1], arr.offset, n)
    elif pa.types.is_integer(arr.type):
        dtype = np.dtype(arr.type.to_pandas_dtype())
        buf = arr.buffers()[1]
        at = arr.offset * dtype.itemsize
        out = np.zeros(0, dtype) if buf is None else np.frombuffer(buf, dtype, count=n, offset=at)
    else:
        raise TypeError(f"filled: a boolean or integer column, not {arr.type}")
    if arr.null_count:
        out = np.where(_bits(arr.buffers()[0], arr.offset, n), out, np.asarray(value, out.dtype))
    return out


def list_lengths(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """int64 length of every list of a list column (null lists count as empty)."""
    return filled(pc.list_value_length(col), 0).astype(np.int64)


def flat_list(col: pa.Array | pa.ChunkedArray, dtype=None) -> tuple[np.ndarray, np.ndarray]:
    """Flat values (cast to ``dtype`` if given) and int64 offsets of a list column; null lists count as empty."""
    arr = _one_chunk(col)
    if pa.types.is_list(arr.type) and arr.values.null_count == 0:
        # Read the list's own offsets in place; a null list spanning values (legal Arrow, which pyarrow
        # never builds) takes the general path, which leaves those values out.
        raw = np.frombuffer(arr.buffers()[1], dtype=np.int32)[arr.offset : arr.offset + len(arr) + 1]
        if not arr.null_count or not np.diff(raw)[~pc.is_valid(arr).to_numpy(zero_copy_only=False)].any():
            values = arr.values.slice(int(raw[0]), int(raw[-1] - raw[0])).to_numpy(zero_copy_only=False)
            offsets = raw.astype(np.int64) - int(raw[0])
            return (values if dtype is None else values.astype(dtype, copy=False)), offsets
    offsets = offsets_from_lengths(list_lengths(arr))
    values = pc.list_flatten(arr).to_numpy(zero_copy_only=False)
    return (values if dtype is None else values.astype(dtype, copy=False)), offsets


def row_selection(idx: np.ndarray, n: int) -> slice | np.ndarray | None:
    """Sorted row indices of ``n`` rows as None (all of them), a slice (one stretch) or themselves."""
    if len(idx) == n:
        return None
    if len(idx) and int(idx[-1]) - int(idx[0]) + 1 == len(idx):
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


def pick_rows(x, sel: slice | np.ndarray | None):
    """The rows ``sel`` (see :func:`row_selection`) of an Arrow table or array: sliced in place, or taken."""
    if sel is None:
        return x
    if isinstance(sel, slice):
        return x.slice(sel.start, sel.stop - sel.start)
    return x.take(pa.array(sel))
