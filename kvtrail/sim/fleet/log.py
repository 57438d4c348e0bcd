"""One simulated producer's events, collected column-wise and turned into Arrow batches.

The fleet simulator emits tens of events per request; building a Python dict per event would cost
more than the store's whole ingest. A :class:`ProducerLog` instead appends each event to a handful
of Python lists (kind, time, request, page array) and keeps every other payload field sparse (the
rows that carry it and their values), so a batch is a few numpy/pyarrow calls per column, never
per-page Python work. It numbers events ``seq`` = 0, 1, 2, ... and keeps ``wall_ns`` strictly
increasing (an event at or before the previous one is moved 1 ns after it).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from kvtrail.audit.arrowutil import list_from_items
from kvtrail.audit.batch import BATCH_SCHEMA, NULLABLE_BATCH_SCHEMA
from kvtrail.audit.events import KIND_NAMES, SCHEMA_VERSION, Producer

_TYPES = {f.name: f.type for f in BATCH_SCHEMA}
_NUMPY = {pa.int32(): np.int32, pa.int64(): np.int64, pa.uint64(): np.uint64, pa.bool_(): np.bool_}
_KIND_DICT = pa.array(KIND_NAMES)
_REQUEST_COLUMNS = (
    ("request_id", pa.string()),
    ("tenant_id", pa.string()),
    ("api_key_id", pa.string()),
    ("transfer_id", pa.uint64()),
)


class ProducerLog:
    """Events of one producer since the last :meth:`flush`, plus its running ``seq`` and clock.

    ``req`` passed to :meth:`add` is any object whose ``ident`` is the tuple (request_id, tenant_id,
    api_key_id, transfer_id), or None for events without a request (``node_config``, evictions). Only
    that tuple is kept, so pending events do not keep finished requests (and their pages) alive.
    """

    def __init__(self, producer: Producer, *, start_wall_ns: int, mono_base_ns: int):
        self.producer = producer
        self.start_wall_ns = start_wall_ns
        self.mono_base_ns = mono_base_ns
        self.next_seq = 0
        self.last_wall_ns = -1
        self.num_events = 0  # emitted in total (flushed or not)
        self.num_page_events = 0  # entries of 'pages' lists emitted in total
        self._reset()

    def _reset(self) -> None:
        self.kind: list[int] = []
        self.wall: list[int] = []
        self.req: list = []
        self.pages: list = []
        self.sparse: dict[str, tuple[list[int], list]] = {}
        self.pending_pages = 0

    def __len__(self) -> int:
        return len(self.kind)

    def add(self, t_ns: int, kind: int, req, pages: np.ndarray | None = None, **fields) -> int:
        """Record one event at ``t_ns`` (moved just after the previous event if not later); returns its wall_ns."""
        wall = t_ns if t_ns > self.last_wall_ns else self.last_wall_ns + 1
        self.last_wall_ns = wall
        i = len(self.kind)
        self.kind.append(kind)
        self.wall.append(wall)
        self.req.append(None if req is None else req.ident)
        self.pages.append(pages)
        if pages is not None:
            self.pending_pages += len(pages)
            self.num_page_events += len(pages)
        self.num_events += 1
        sparse = self.sparse
        for name, value in fields.items():
            col = sparse.get(name)
            if col is None:
                col = sparse[name] = ([], [])
            col[0].append(i)
            col[1].append(value)
        return wall

    def flush(self) -> pa.Table | None:
        """The events since the last flush as one batch (exactly BATCH_SCHEMA's columns), or None."""
        n = len(self.kind)
        if n == 0:
            return None
        first_seq = self.next_seq
        self.next_seq += n
        wall = np.array(self.wall, dtype=np.int64)
        cols: dict[str, pa.Array] = {
            "schema_version": pa.array(np.full(n, SCHEMA_VERSION, np.int32)),
            "seq": pa.array(np.arange(first_seq, first_seq + n, dtype=np.uint64)),
            "wall_ns": pa.array(wall),
            "mono_ns": pa.array(wall - self.start_wall_ns + self.mono_base_ns),
            "kind": pa.DictionaryArray.from_arrays(pa.array(np.array(self.kind, np.int8)), _KIND_DICT).cast(
                pa.string()
            ),
        }
        for name in ("cluster", "node", "role", "engine", "engine_version", "instance"):
            cols[name] = pa.DictionaryArray.from_arrays(
                pa.array(np.zeros(n, np.int8)), pa.array([getattr(self.producer, name)])
            ).cast(pa.string())
        for i, (name, type_) in enumerate(_REQUEST_COLUMNS):
            cols[name] = pa.array([r[i] if r is not None else None for r in self.req], type_)
        cols["pages"] = list_from_items(self.pages, pa.int32(), np.int32, field="max_pages_per_batch")
        for name, (rows, values) in self.sparse.items():
            cols[name] = _sparse_column(name, rows, values, n)
        self._reset()
        arrays = [cols[f.name] if f.name in cols else pa.nulls(n, f.type) for f in BATCH_SCHEMA]
        return pa.Table.from_arrays(arrays, schema=NULLABLE_BATCH_SCHEMA)


def _sparse_column(name: str, rows: list[int], values: list, n: int) -> pa.Array:
    type_ = _TYPES[name]
    if pa.types.is_list(type_):
        items: list = [None] * n
        for r, v in zip(rows, values, strict=True):
            items[r] = v
        return list_from_items(items, type_.value_type, _NUMPY[type_.value_type], field="max_pages_per_batch")
    if pa.types.is_string(type_):
        items = [None] * n
        for r, v in zip(rows, values, strict=True):
            items[r] = v
        return pa.array(items, pa.string())
    arr: np.ndarray = np.zeros(n, dtype=_NUMPY[type_])
    idx = np.array(rows, dtype=np.int64)
    arr[idx] = values
    mask = np.ones(n, dtype=bool)
    mask[idx] = False
    return pa.array(arr, type_, mask=mask)
