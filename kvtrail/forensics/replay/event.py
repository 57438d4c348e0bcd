"""One audit event as the replay engine's Python handlers read it.

:class:`ReplayEvent` is built once per event that goes through a handler: by
:class:`~kvtrail.forensics.replay.engine.ReplayEngine` for every event on the pure path, by
:class:`~kvtrail.forensics.replay.batch.ReplayBatch` for the rare events of the compiled path. It is a
NamedTuple rather than a dataclass because the pure path builds one per event and a tuple is built
from a row's values in one call (several times faster than a frozen dataclass or a dict).

Its first fields are the wire fields the handlers read (:data:`SCALARS`, the columns both paths take
from a batch), in the audit schema's types; a field the event's kind does not carry is None. The rest
is what the engine derives: the producer's node and instance, the event's key, its place in the
engine's order and its lists as numpy arrays.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

NodeKey = tuple[str, str]  # (cluster, node): the pool an event belongs to
EventKey = tuple[int, int]  # (producer_id, seq): how findings name the events that prove them


class ReplayEvent(NamedTuple):
    """An event in the replay engine's order, with its page lists as arrays."""

    kind: str
    seq: int
    wall_ns: int
    request_id: str | None
    transfer_id: int | None
    tenant_id: str | None
    purpose: str | None
    num_tokens: int | None
    digest: int | None
    digest_algo: str | None
    status: str | None
    http_status: int | None
    stage: str | None
    abort_reason: str | None
    pool_tokens: int | None
    pool_pages: int | None
    context_tokens: int | None
    page_size: int | None
    source: str | None
    token_start: int | None
    token_end: int | None
    prompt_tokens: int | None
    completion_tokens: int | None
    ttft_ns: int | None
    release_timeout_ns: int | None
    # ---- derived by the engine ----
    node_key: NodeKey
    instance: str
    key: EventKey
    ord: int  # position in the engine's order over everything fed so far
    pages: np.ndarray  # int64 page ids ('pages'; empty when absent)
    digests: np.ndarray | None  # uint64 'page_digests', None when absent or empty
    hashes: np.ndarray | None  # int64 'block_hashes', None when absent or empty
    num_dst_pages: int  # length of 'dst_pages'


# The wire fields the handlers read (besides producer identity and the lists), in ReplayEvent's order.
SCALARS: tuple[str, ...] = ReplayEvent._fields[: ReplayEvent._fields.index("node_key")]


def required(value: int | None, name: str) -> int:
    """A field the event's kind must carry (the audit schema requires it of that kind)."""
    if value is None:
        raise ValueError(f"replay: {name} missing on an event that needs it")
    return value
