"""The synthetic stream's batch builder: allocator events collected as a few Python lists, then turned
into one Arrow batch (exactly BATCH_SCHEMA's columns) with per-column numpy/pyarrow calls.

The stream (:mod:`kvtrail.sim.synth`) emits only four kinds: ``node_config``, ``pages_allocated``,
``kv_written`` and ``pages_freed``; purposes and free reasons are small integer codes here.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from kvtrail.audit.arrowutil import list_from_items
from kvtrail.audit.batch import BATCH_SCHEMA, NULLABLE_BATCH_SCHEMA
from kvtrail.audit.events import FREE_REASONS, KIND_CODES, KIND_NAMES, SCHEMA_VERSION, Producer

_TYPES = {f.name: f.type for f in BATCH_SCHEMA}

K_CONFIG = KIND_CODES["node_config"]
K_ALLOC = KIND_CODES["pages_allocated"]
K_FREE = KIND_CODES["pages_freed"]
K_WRITE = KIND_CODES["kv_written"]
# Index into the small dictionaries used to build enum columns (-1: no value).
PURPOSES = ("prefill_extend", "decode_growth")
P_PREFILL, P_GROWTH = 0, 1
R_FINISH, R_ABORT, R_RETRACT = (FREE_REASONS.index(r) for r in ("finish", "abort", "retract"))
_LISTS = ("kind", "wall", "rid", "tenant", "xfer", "pages", "purpose", "reason", "tstart", "tend")


class BatchBuilder:
    """One producer's events since the last batch, one Python list per column."""

    def __init__(self, producer: Producer, config: dict | None):
        self.producer = producer
        self.config = config  # node_config values when this batch starts with the config event
        self.kind: list[int] = []
        self.wall: list[int] = []
        self.rid: list[str | None] = []
        self.tenant: list[str | None] = []
        self.xfer: list[int | None] = []
        self.pages: list[np.ndarray | None] = []
        self.purpose: list[int] = []
        self.reason: list[int] = []
        self.tstart: list[int] = []
        self.tend: list[int] = []

    def __len__(self) -> int:
        return len(self.kind)

    def add(
        self,
        kind: int,
        wall_ns: int,
        ident: tuple[str, str, int] | None,
        pages: np.ndarray | None,
        purpose: int,
        reason: int,
        token_start: int,
        token_end: int,
    ) -> None:
        """One event; ``ident`` is (request_id, tenant_id, transfer_id) or None, the codes are -1 when unset."""
        self.kind.append(kind)
        self.wall.append(wall_ns)
        rid, tenant, xfer = (None, None, None) if ident is None else ident
        self.rid.append(rid)
        self.tenant.append(tenant)
        self.xfer.append(xfer)
        self.pages.append(pages)
        self.purpose.append(purpose)
        self.reason.append(reason)
        self.tstart.append(token_start)
        self.tend.append(token_end)

    def split_off(self, k: int) -> BatchBuilder:
        """Keep the first ``k`` events; return a builder holding the rest (carried into the next batch)."""
        rest = BatchBuilder(self.producer, None)
        for name in _LISTS:
            values = getattr(self, name)
            setattr(rest, name, values[k:])
            del values[k:]
        return rest

    def table(self, first_seq: int, mono_offset_ns: int) -> pa.Table:
        """The events as one batch, numbered from ``first_seq``; ``mono_ns`` is ``wall_ns + mono_offset_ns``."""
        n = len(self.kind)
        kind = np.array(self.kind, dtype=np.int8)
        wall = np.array(self.wall, dtype=np.int64)
        cols: dict[str, pa.Array] = {
            "schema_version": pa.repeat(pa.scalar(SCHEMA_VERSION, pa.int32()), n),
            "seq": pa.array(np.arange(first_seq, first_seq + n, dtype=np.uint64)),
            "wall_ns": pa.array(wall),
            "mono_ns": pa.array(wall + mono_offset_ns),
            "kind": pa.DictionaryArray.from_arrays(pa.array(kind), pa.array(KIND_NAMES)).cast(pa.string()),
            "request_id": pa.array(self.rid, pa.string()),
            "tenant_id": pa.array(self.tenant, pa.string()),
            "transfer_id": pa.array(self.xfer, pa.uint64()),
        }
        for name in ("cluster", "node", "role", "engine", "engine_version", "instance"):
            cols[name] = pa.repeat(pa.scalar(getattr(self.producer, name), pa.string()), n)
        cols["pages"] = list_from_items(self.pages, pa.int32(), np.int32, field="events_per_batch")
        cols["purpose"] = _enum(self.purpose, PURPOSES)
        cols["free_reason"] = _enum(self.reason, FREE_REASONS)
        is_write = kind == K_WRITE
        cols["source"] = _enum(np.where(is_write, 0, -1), ("forward",))
        for name, values in (("token_start", self.tstart), ("token_end", self.tend)):
            v = np.array(values, dtype=np.int64)
            cols[name] = pa.array(v, mask=v < 0)
        if self.config is not None:
            # The node_config event is row 0 of the first batch.
            first = np.zeros(n, dtype=bool)
            first[0] = True
            for name, value in self.config.items():
                type_ = _TYPES[name]
                if pa.types.is_string(type_):
                    cols[name] = pa.array([value] + [None] * (n - 1), type_)
                else:
                    cols[name] = pa.array(np.full(n, value), type_, mask=~first)
        arrays = [cols[f.name] if f.name in cols else pa.nulls(n, f.type) for f in BATCH_SCHEMA]
        return pa.Table.from_arrays(arrays, schema=NULLABLE_BATCH_SCHEMA)


def _enum(codes, choices: tuple[str, ...]) -> pa.Array:
    """A string column from small integer codes (-1 = null)."""
    idx = np.asarray(codes, dtype=np.int8)
    return pa.DictionaryArray.from_arrays(pa.array(idx, mask=idx < 0), pa.array(choices)).cast(pa.string())
