"""What a replay knows between events, in one object both of the engine's paths are handed.

:class:`ReplayState` is made by :class:`~kvtrail.forensics.replay.engine.ReplayEngine` and passed
explicitly to the Python handlers (:class:`~kvtrail.forensics.replay.handlers.EventHandlers`) and to
the compiled path (:class:`~kvtrail.forensics.replay.fast.FastReplay`); neither reaches into the other
or into the engine. Everything the two paths must agree on lives here: the node pools' page state,
request indices (they decide which extra holder a released page passes to), tenants, the cross-node
joins' collections, the events' order numbers and the findings emitted so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvtrail.forensics.findings import Finding
from kvtrail.forensics.replay.batch import first_rows
from kvtrail.forensics.replay.event import NodeKey
from kvtrail.forensics.replay.joins import CrossNodeJoins
from kvtrail.forensics.replay.pagestate import PageState


@dataclass(eq=False)
class ReplayState:
    """The state of one replay, fed batch by batch."""

    joins: CrossNodeJoins
    pools: dict[NodeKey, PageState] = field(default_factory=dict)
    pool_instance: dict[NodeKey, str] = field(default_factory=dict)  # the producer instance a pool belongs to
    # Requests by index, as the page arrays name them (a write without request id registers None).
    requests: list[str | None] = field(default_factory=list)
    request_index: dict[str | None, int] = field(default_factory=dict)
    tenants: dict[str, str] = field(default_factory=dict)  # request_id -> tenant of its first event naming one
    found: list[Finding] = field(default_factory=list)  # the per-node findings, as emitted
    num_events: int = 0  # events fed so far: the next event's order number

    def req(self, request_id: str | None) -> int:
        """The index of a request, registering it when new."""
        r = self.request_index.get(request_id)
        if r is None:
            r = self.request_index[request_id] = len(self.requests)
            self.requests.append(request_id)
        return r

    def take_ords(self, num_events: int) -> int:
        """Order numbers for ``num_events`` new events: returns the first."""
        first = self.num_events
        self.num_events += num_events
        return first

    def register_requests(self, is_page_event: np.ndarray, rcode: np.ndarray, request_ids: list[str]) -> None:
        """Give the request ids of a batch's page events their indices, in order of first appearance.

        Both engine paths do this before replaying a batch, so that a request has the same index in
        both. What :meth:`req` does for one id, done for the batch's new ids at once.
        """
        codes = rcode[is_page_event & (rcode >= 0)]
        first = first_rows(codes, len(request_ids))
        seen = np.flatnonzero(first < len(codes))
        index = self.request_index
        new = [rid for rid in (request_ids[k] for k in seen[np.argsort(first[seen])].tolist()) if rid not in index]
        index.update(zip(new, range(len(self.requests), len(self.requests) + len(new))))
        self.requests.extend(new)
