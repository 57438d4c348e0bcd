"""Arrow helpers every batch builder shares: nullable schemas and list columns as (flat values, offsets).

Page lists travel as Arrow list columns. Builders hold them as per-row arrays, readers want them as
one flat array plus offsets (list ``i`` is ``flat[offsets[i]:offsets[i + 1]]``, a null list counts
as empty). These helpers do both directions in a few C-level passes, never per page in Python.
"""

from __future__ import annotations

from itertools import chain
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
    lengths = np.fromiter((0 if v is None else len(v) for v in items), dtype=np.int64, count=n)
    offsets = offsets_from_lengths(lengths)
    present = [v for v in items if v is not None and len(v)]
    if not present:
        flat = np.empty(0, dtype=dtype)
    elif all(type(v) is np.ndarray for v in present):
        flat = np.concatenate(present).astype(dtype, copy=False)
    else:
        flat = np.fromiter(chain.from_iterable(present), dtype=dtype, count=int(offsets[-1]))
    absent = np.fromiter((v is None for v in items), dtype=bool, count=n)
    return flat, offsets, absent if absent.any() else None


def list_array(flat: np.ndarray, offsets: np.ndarray, value_type: pa.DataType, absent: np.ndarray | None = None,
               *, field: str = "pages") -> pa.ListArray:
    """An Arrow list column from flat values and int64 offsets; ``absent`` (bool per row) marks null lists.

    Raises ValueError naming ``field`` when the lists hold more entries than 32-bit offsets address.
    """
    if len(offsets) and int(offsets[-1]) > INT32_MAX:
        raise ValueError(f"{field}: a batch would hold more than 2**31 - 1 list entries")
    return pa.ListArray.from_arrays(pa.array(np.asarray(offsets).astype(np.int32)), pa.array(flat, value_type),
                                    mask=None if absent is None else pa.array(absent))


def list_from_items(items: Sequence, value_type: pa.DataType, dtype, *, field: str = "pages") -> pa.ListArray:
    """An Arrow list column from per-row lists (ndarray, tuple, list or None for a null list)."""
    flat, offsets, absent = pack_lists(items, dtype)
    return list_array(flat, offsets, value_type, absent, field=field)


def list_lengths(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """int64 length of every list of a list column (null lists count as empty)."""
    return pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False).astype(np.int64)


def flat_list(col: pa.Array | pa.ChunkedArray, dtype=None) -> tuple[np.ndarray, np.ndarray]:
    """Flat values (cast to ``dtype`` if given) and int64 offsets of a list column; null lists count as empty."""
    offsets = offsets_from_lengths(list_lengths(col))
    values = pc.list_flatten(col).to_numpy(zero_copy_only=False)
    return (values if dtype is None else values.astype(dtype, copy=False)), offsets
