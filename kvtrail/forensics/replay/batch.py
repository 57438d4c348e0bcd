"""Events in the replay engine's order as flat columns: what the compiled fast path reads.

A :class:`ReplayBatch` holds one batch of events sorted in engine order (``wall_ns``, cluster,
node, instance, ``seq``): numpy arrays for everything the page kernel needs (producer id, clocks,
page lists flattened with offsets) and the engine's scalar columns as Arrow, from which the few
events that go through the Python handlers are built as
:class:`~kvtrail.forensics.replay.event.ReplayEvent`. :func:`from_table` builds one from a wire-shaped
Arrow batch; :mod:`kvtrail.forensics.replay.source` builds them straight from a store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrail.audit.arrowutil import filled, flat_list
from kvtrail.audit.events import PRODUCER_FIELDS
from kvtrail.forensics.replay.event import SCALARS, ReplayEvent

PRODUCER_NAMES = tuple(f.name for f in PRODUCER_FIELDS)
PAGE_KINDS = ("pages_allocated", "pages_freed", "kv_written", "kv_read")
# Kinds whose only effect is on the cross-node joins (F2, F3, F4, F9).
JOIN_KINDS = (
    "transfer_reserved",
    "transfer_sent",
    "transfer_received",
    "request_aborted",
    "request_received",
    "response_sent",
)
JOIN_CODES = frozenset({"F2", "F3", "F4", "F9", "F11"})
_SEQ = SCALARS.index("seq")
# Every column ReplayEngine.feed reads of a table (either path): a caller may select these before sorting
FEED_COLUMNS = (*SCALARS, *PRODUCER_NAMES, "producer_id", "pages", "page_digests", "block_hashes", "dst_pages")
ENGINE_ORDER = [
    ("wall_ns", "ascending"),
    ("cluster", "ascending"),
    ("node", "ascending"),
    ("instance", "ascending"),
    ("seq", "ascending"),
]


@dataclass
class ReplayBatch:
    """One batch in engine order. Offsets have ``num_rows + 1`` entries; absent lists are empty."""

    scalars: pa.Table  # SCALARS columns, one chunk each
    pid: np.ndarray  # int64 producer id per row
    producer: np.ndarray  # int64 index into idents per row
    idents: list[tuple]  # identities (cluster, node, role, engine, engine_version, instance) in the batch
    rcode: np.ndarray  # int32 index into request_ids per row (-1: no request id)
    request_ids: list[str]  # the batch's distinct request ids
    pages: np.ndarray  # int32 page ids of the 'pages' lists, back to back
    poff: np.ndarray  # int64
    digests: np.ndarray  # uint64 'page_digests'
    doff: np.ndarray
    hashes: np.ndarray  # int64 'block_hashes'
    hoff: np.ndarray
    num_dst_pages: np.ndarray  # int64 length of 'dst_pages'
    _columns: dict[str, pa.Array] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_rows(self) -> int:
        return len(self.pid)

    @property
    def num_page_events(self) -> int:
        return int(self.poff[-1])

    def column(self, name: str) -> pa.Array:
        col = self._columns.get(name)  # the events handed to Python ask often
        if col is None:
            col = self._columns[name] = self.scalars.column(name).chunk(0)
        return col

    def ints(self, name: str) -> np.ndarray:
        """An integer column as int64 (nulls as 0; uint64 values wrap)."""
        return filled(self.column(name), 0).astype(np.int64)

    def event(self, i: int, ord_: int) -> ReplayEvent:
        """Row ``i`` as the handlers take it (the same values the pure path builds)."""
        ident = self.idents[self.producer[i]]
        scalars = [self.column(name)[i].as_py() for name in SCALARS]  # ~15 us: only for rare events
        pages = self.pages[self.poff[i] : self.poff[i + 1]].astype(np.int64)
        return ReplayEvent._make(
            (*scalars, (ident[0], ident[1]), ident[5], (int(self.pid[i]), scalars[_SEQ]), ord_, pages, *self._lists(i))
        )

    def events(self, rows: np.ndarray, ord0: int) -> dict[int, ReplayEvent]:
        """Events of many rows at once (row -> event); ``ord0 + row`` is each one's order number."""
        if not len(rows):
            return {}
        cols = self.scalars.take(pa.array(rows)).to_pydict()
        lengths = self.poff[rows + 1] - self.poff[rows]
        ends = np.cumsum(lengths)
        flat = self.pages[np.arange(ends[-1]) + np.repeat(self.poff[rows] - (ends - lengths), lengths)].astype(np.int64)
        node_keys = [(ident[0], ident[1]) for ident in self.idents]
        instances = [ident[5] for ident in self.idents]
        out = {}
        for vals, seq, i, lo, hi, k, pid in zip(
            zip(*(cols[name] for name in SCALARS)),
            cols["seq"],
            rows.tolist(),
            (ends - lengths).tolist(),
            ends.tolist(),
            self.producer[rows].tolist(),
            self.pid[rows].tolist(),
        ):
            out[i] = ReplayEvent._make(
                (*vals, node_keys[k], instances[k], (pid, seq), ord0 + i, flat[lo:hi], *self._lists(i))
            )
        return out

    def _lists(self, i: int) -> tuple[np.ndarray | None, np.ndarray | None, int]:
        """(digests, block hashes, dst_pages length) of row ``i``: ReplayEvent's last fields."""
        d0, d1, h0, h1 = self.doff[i], self.doff[i + 1], self.hoff[i], self.hoff[i + 1]
        return (
            self.digests[d0:d1] if d1 > d0 else None,
            self.hashes[h0:h1] if h1 > h0 else None,
            int(self.num_dst_pages[i]),
        )


def first_rows(codes: np.ndarray, k: int) -> np.ndarray:
    """Row of each code's first occurrence (codes 0..k-1; ``len(codes)`` where a code never occurs)."""
    first = np.full(k, len(codes), np.int64)
    np.minimum.at(first, codes, np.arange(len(codes), dtype=np.int64))
    return first


def request_codes(col) -> tuple[np.ndarray, list[str]]:
    """(index per row, -1 where null; the distinct request ids) of a request_id column."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    enc = col.dictionary_encode()
    return filled(enc.indices, -1).astype(np.int32), enc.dictionary.to_pylist()


def codes_of(col, names: tuple[str, ...]) -> np.ndarray:
    """Index of each value in ``names`` (-1: null or not among them)."""
    return filled(pc.index_in(col, value_set=pa.array(names)), -1)


def in_engine_order(table: pa.Table) -> pa.Table:
    """The table sorted in engine order, one chunk per column; a table already in that order (a recorder's
    batch, or one this sorted before) is taken as it is, without moving its rows."""
    keys = table.select([k for k, _ in ENGINE_ORDER])
    one_producer = all(
        pc.count_distinct(keys.column(n), mode="all").as_py() <= 1 for n in ("node", "instance", "cluster")
    )
    if one_producer and keys.column("wall_ns").null_count == 0 and keys.column("seq").null_count == 0:
        wall = keys.column("wall_ns").to_numpy()
        seq = keys.column("seq").to_numpy()
        if np.all((wall[1:] > wall[:-1]) | ((wall[1:] == wall[:-1]) & (seq[1:] > seq[:-1]))):
            return table.combine_chunks()
    # the order is found from the keys alone; the rows move only if it differs, and a column with no
    # value in any row (most of a commit's: each kind fills a few) is made afresh rather than moved
    order = pc.sort_indices(keys, sort_keys=ENGINE_ORDER)
    if bool(np.all(np.diff(order.to_numpy()) == 1)):
        return table.combine_chunks()
    n = table.num_rows
    columns = [pa.nulls(n, col.type) if col.null_count == n else _chunk(col.take(order)) for col in table.itercolumns()]
    return pa.Table.from_arrays(columns, schema=table.schema)


def _identity_codes(table: pa.Table) -> np.ndarray:
    """A code per row, equal for rows of the same producer identity (codes in any order). A table with a
    ``producer_id`` in every row (what a store committed or holds: one id per identity) is coded by it,
    one integer column instead of the six identity strings."""
    if "producer_id" in table.schema.names and table.column("producer_id").null_count == 0:
        return _compact(table.column("producer_id").to_numpy().astype(np.int64, copy=False))
    key = np.zeros(table.num_rows, np.int64)
    for name in PRODUCER_NAMES:
        enc = table.column(name).combine_chunks().dictionary_encode()
        if len(enc.dictionary) <= 1 and not enc.null_count:
            continue
        codes = filled(enc.indices, -1).astype(np.int64) + 1
        key = _compact(key * (len(enc.dictionary) + 1) + codes)
    return key


def _compact(key: np.ndarray) -> np.ndarray:
    """Non-negative ``key`` renumbered 0..k-1, equal keys equal codes."""
    if not len(key):
        return key
    if key.min() >= 0 and key.max() < 1 << 24:  # through a lookup table: O(rows), no sort
        present = np.zeros(int(key.max()) + 1, np.int64)
        present[key] = 1
        return (np.cumsum(present) - 1)[key]
    return np.unique(key, return_inverse=True)[1].astype(np.int64).reshape(-1)


def _chunk(col) -> pa.Array:
    return col.chunk(0) if isinstance(col, pa.ChunkedArray) and col.num_chunks == 1 else col.combine_chunks()


def from_table(table: pa.Table, producer_id: Callable[[tuple], int]) -> ReplayBatch:
    """A batch from a wire-shaped table already in engine order (see :func:`in_engine_order`).

    Producer ids come from the table's ``producer_id`` column when it has one, else from
    ``producer_id(identity)``, called in order of each identity's first row (as the pure path does).
    """
    codes = _identity_codes(table)
    k = int(codes.max(initial=-1)) + 1
    first = first_rows(codes, k)
    order = np.argsort(first)  # identities in order of first appearance
    rank = np.empty(k, np.int64)
    rank[order] = np.arange(k)
    producer = rank[codes]
    idents = [tuple(table.column(name)[int(i)].as_py() for name in PRODUCER_NAMES) for i in first[order]]
    if "producer_id" in table.column_names:
        pid = table.column("producer_id").to_numpy(zero_copy_only=False).astype(np.int64)
    else:
        pid = np.array([producer_id(ident) for ident in idents], np.int64)[producer]
    rcode, request_ids = request_codes(table.column("request_id"))
    pages, poff = flat_list(table.column("pages"), np.int32)
    digests, doff = flat_list(table.column("page_digests"), np.uint64)
    hashes, hoff = flat_list(table.column("block_hashes"), np.int64)
    ndst = filled(pc.list_value_length(table.column("dst_pages")), 0)
    scalars = pa.table({name: _chunk(table.column(name)) for name in SCALARS})
    return ReplayBatch(
        scalars,
        pid,
        producer,
        idents,
        rcode,
        request_ids,
        pages,
        poff,
        digests,
        doff,
        hashes,
        hoff,
        ndst.astype(np.int64),
    )
