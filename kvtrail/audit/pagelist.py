"""Run-length encoding of page lists, vectorised.

An allocator hands out mostly contiguous runs of page ids, so a list like ``[7, 8, 9, 10, 42, 43]``
is stored as runs ``(pos=0, start=7, len=4), (pos=4, start=42, len=2)``. ``pos`` is the index of the
run's first page inside the list, which keeps order (and the page's place in the request's page
table) exact on the way back.
"""

from __future__ import annotations

import numpy as np


def encode_runs(flat: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Encode many page lists at once.

    ``flat`` holds every list's pages back to back; list ``i`` is ``flat[offsets[i]:offsets[i+1]]``;
    page ids are non-negative (the store validates them before encoding). Returns ``(row, pos, start,
    length)``: for each run, the list it belongs to, its position inside that list, its first page id
    and its number of pages. Runs come out in list order, then position.
    """
    flat = np.asarray(flat)
    offsets = np.asarray(offsets, dtype=np.int64)
    n = flat.shape[0]
    if n == 0:
        empty = np.empty(0, dtype=np.int32)
        return np.empty(0, dtype=np.int64), empty, empty, empty
    is_break = np.empty(n, dtype=bool)
    is_break[0] = True
    # Compared in the ids' own type, without widening (a third of the cost of a large batch was the
    # int64 copies): id + 1 wraps only at the type's maximum, to a negative number, which no
    # non-negative next id equals, so the wrap still reads as a break.
    np.not_equal(flat[1:], flat[:-1] + 1, out=is_break[1:])
    list_starts = offsets[:-1][offsets[:-1] < offsets[1:]]  # starts of non-empty lists
    is_break[list_starts] = True
    brk = np.flatnonzero(is_break)
    length = np.diff(np.append(brk, n)).astype(np.int32)
    row = np.searchsorted(offsets, brk, side="right") - 1
    pos = (brk - offsets[row]).astype(np.int32)
    start = flat[brk].astype(np.int32, copy=False)
    return row.astype(np.int64, copy=False), pos, start, length


def decode_runs(num_lists: int, row: np.ndarray, start: np.ndarray,
                length: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`encode_runs` (runs must be in list order, then position).

    Returns ``(flat, offsets)`` with ``offsets`` of length ``num_lists + 1``.
    """
    row = np.asarray(row, dtype=np.int64)
    start = np.asarray(start, dtype=np.int64)
    length = np.asarray(length, dtype=np.int64)
    total = int(length.sum())
    counts = np.bincount(row, weights=length, minlength=num_lists).astype(np.int64)
    offsets = np.zeros(num_lists + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    if total == 0:
        return np.empty(0, dtype=np.int32), offsets
    run_first = np.zeros(len(length), dtype=np.int64)
    np.cumsum(length[:-1], out=run_first[1:])
    run_of = np.repeat(np.arange(len(length)), length)
    flat = start[run_of] + (np.arange(total, dtype=np.int64) - run_first[run_of])
    return flat.astype(np.int32), offsets


def count_runs(pages) -> int:
    """Number of contiguous runs in one page list (for reporting)."""
    arr = np.asarray(pages, dtype=np.int64)
    if arr.size == 0:
        return 0
    return int(1 + np.count_nonzero(np.diff(arr) != 1))
