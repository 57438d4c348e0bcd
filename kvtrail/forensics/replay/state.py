"""What a replay knows between events, in one object both of the engine's paths are handed.

:class:`ReplayState` is made by :class:`~kvtrail.forensics.replay.engine.ReplayEngine` and passed
explicitly to the Python handlers (:class:`~kvtrail.forensics.replay.handlers.EventHandlers`) and to
the compiled path (:class:`~kvtrail.forensics.replay.fast.FastReplay`); neither reaches into the other
or into the engine. Everything the two paths must agree on lives here: the node pools' page state,
request indices (they decide which extra holder a released page passes to), tenants, the cross-node
joins' collections, the events' order numbers and the findings emitted so far.

A request is what the store numbers it by, never its id text alone (clients choose request ids, so two
tenants' requests can share one): its id and its tenant. An event naming a tenant belongs to the request
(id, that tenant); an event of the id naming none belongs to the request of the first tenant named for the
id in the engine's order (before or after it), or, where no event of the id names a tenant, to the id's
tenant-less request. ``docs/findings.md`` ("Requests") states it; the SQL engine keys requests the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from kvtrail.audit.arrowutil import filled
from kvtrail.forensics.findings import Finding
from kvtrail.forensics.replay.event import NodeKey
from kvtrail.forensics.replay.joins import CrossNodeJoins
from kvtrail.forensics.replay.pagestate import PageState
from kvtrail.keys import unique_first

RequestKey = tuple[str | None, str | None]  # (request_id, tenant_id): how the replay identifies a request
_NEVER = 2**62  # tenant_since of a request whose tenant no event has named yet


@dataclass(eq=False)
class ReplayState:
    """The state of one replay, fed batch by batch."""

    joins: CrossNodeJoins
    pools: dict[NodeKey, PageState] = field(default_factory=dict)
    pool_instance: dict[NodeKey, str] = field(default_factory=dict)  # the producer instance a pool belongs to
    # Requests by index, as the page arrays name them (a write without request id registers None): the id,
    # the tenant it is keyed by (None: no event of its id named one yet) and the order number of the first
    # event naming that tenant for it (from then on a finding names its tenant).
    requests: list[str | None] = field(default_factory=list)
    request_tenants: list[str | None] = field(default_factory=list)
    tenant_since: list[int] = field(default_factory=list)
    request_index: dict[RequestKey, int] = field(default_factory=dict)
    # request_id -> the first tenant named for it, as of the end of the batch being replayed
    tenants: dict[str, str] = field(default_factory=dict)
    named: dict[RequestKey, int] = field(default_factory=dict)  # (id, tenant) -> order of its first event
    renamed: list[int] = field(default_factory=list)  # indices whose tenant or tenant_since changed (fast path)
    found: list[Finding] = field(default_factory=list)  # the per-node findings, as emitted
    num_events: int = 0  # events fed so far: the next event's order number

    def __post_init__(self) -> None:
        self.joins.tenants = self.tenants  # the joins resolve an event naming no tenant alike

    def key(self, request_id: str | None, tenant_id: str | None) -> RequestKey:
        """The request an event of ``request_id`` naming ``tenant_id`` (or none) belongs to."""
        if request_id is None:
            return (None, None)
        return (request_id, tenant_id if tenant_id is not None else self.tenants.get(request_id))

    def req(self, request_id: str | None, tenant_id: str | None = None) -> int:
        """The index of the request an event of ``request_id`` (naming ``tenant_id``) belongs to, registered
        when new."""
        return self._index(self.key(request_id, tenant_id))

    def _index(self, key: RequestKey) -> int:
        r = self.request_index.get(key)
        if r is None:
            r = self.request_index[key] = len(self.requests)
            self.requests.append(key[0])
            self.request_tenants.append(key[1])
            self.tenant_since.append(self.named.get(key, _NEVER) if key[1] is not None else _NEVER)
        return r

    def tenant_at(self, r: int, ord_: int) -> str | None:
        """Request ``r``'s tenant as known at order number ``ord_`` (None: not named by then, or nobody)."""
        if r < 0 or self.tenant_since[r] > ord_:
            return None
        return self.request_tenants[r]

    def take_ords(self, num_events: int) -> int:
        """Order numbers for ``num_events`` new events: returns the first."""
        first = self.num_events
        self.num_events += num_events
        return first

    def name_tenant(self, request_id: str, tenant_id: str, ord_: int) -> None:
        """An event at ``ord_`` names ``tenant_id`` for ``request_id`` (called in order, first naming only)."""
        key = (request_id, tenant_id)
        if key in self.named:
            return
        self.named[key] = ord_
        if request_id not in self.tenants:
            self.tenants[request_id] = tenant_id
            # the id's events so far named no tenant: they were this request's
            r = self.request_index.pop((request_id, None), None)
            if r is not None and key not in self.request_index:
                self.request_index[key] = r
                self.request_tenants[r] = tenant_id
        r = self.request_index.get(key)
        if r is not None and self.tenant_since[r] > ord_:
            self.tenant_since[r] = ord_
            self.renamed.append(r)

    def register_requests(
        self, is_page_event: np.ndarray, rcode: np.ndarray, request_ids: list[str], tenant_col, ord0: int
    ) -> np.ndarray:
        """Name a batch's tenants and give its page events' requests their indices, in order of first
        appearance; returns each row's request index (-1: no request id, or not a page event).

        Both engine paths do this before replaying a batch, so that a request has the same index in
        both, and a finding names a request's tenant from the same event on. What :meth:`name_tenant` and
        :meth:`req` do for one event, done for the batch's rows at once.
        """
        n = len(rcode)
        tenant_col = tenant_col.combine_chunks() if isinstance(tenant_col, pa.ChunkedArray) else tenant_col
        enc = tenant_col.dictionary_encode()
        tcode = filled(enc.indices, -1).astype(np.int64)
        tnames: list[str] = enc.dictionary.to_pylist()
        named = np.flatnonzero((rcode >= 0) & (tcode >= 0))
        if len(named):
            combo = rcode[named].astype(np.int64) * (len(tnames) + 1) + tcode[named]
            _, first, _ = unique_first(combo, (len(request_ids) + 1) * (len(tnames) + 1))
            at = np.sort(named[first])
            rids = map(request_ids.__getitem__, rcode[at].tolist())
            self._name_tenants(list(zip(rids, map(tnames.__getitem__, tcode[at].tolist()))), (at + ord0).tolist())
        out = np.full(n, -1, np.int64)
        rows = np.flatnonzero(is_page_event & (rcode >= 0))
        if not len(rows):
            return out
        # each row's tenant: its own, else the first named for its id (-1: none)
        codes = {t: k for k, t in enumerate(tnames)}
        rt = tcode[rows]
        if (rt < 0).any():  # rows naming no tenant: their ids' first tenants
            bare = np.flatnonzero(rt < 0)
            ids = np.unique(rcode[rows[bare]])
            first_tenant = self.tenants.get
            by_id = [
                -1 if (t := first_tenant(request_ids[c])) is None else codes.setdefault(t, len(codes))
                for c in ids.tolist()
            ]
            rt[bare] = np.array(by_id, np.int64)[np.searchsorted(ids, rcode[rows[bare]])]
        names: list[str | None] = [*codes, None]  # code -1: no tenant
        combo = rcode[rows].astype(np.int64) * (len(names) + 1) + (rt + 1)
        uniq, first, inverse = unique_first(combo, (len(request_ids) + 1) * (len(names) + 1))
        index = np.empty(len(uniq), np.int64)
        order = np.argsort(first, kind="stable")
        at = first[order]
        keys: list[RequestKey] = list(
            zip(map(request_ids.__getitem__, rcode[rows[at]].tolist()), map(names.__getitem__, rt[at].tolist()))
        )
        index[order] = self._indices(keys)
        out[rows] = index[inverse.reshape(-1)]
        return out

    def _name_tenants(self, keys: list[tuple[str, str]], ords: list[int]) -> None:
        """``name_tenant`` for each (distinct) key at its order number, in order. A key not named yet, neither
        indexed nor its id's tenant-less request (the common case), is only recorded: in bulk."""
        named, index, tenants = self.named, self.request_index, self.tenants
        fresh = [(k, o) for k, o in zip(keys, ords) if k not in named]
        if any(k in index or (k[0], None) in index for k, _ in fresh):
            for (request_id, tenant_id), o in zip(keys, ords):
                self.name_tenant(request_id, tenant_id, o)
            return
        named.update(reversed(fresh))  # (reversed: a repeated key keeps its first order number)
        tenants.update({rid: t for (rid, t), _ in reversed(fresh) if rid not in tenants})  # the first naming wins

    def _indices(self, keys: list[RequestKey]) -> list[int]:
        """``_index`` of each (distinct) key, in order: new keys get the next indices."""
        index = self.request_index
        got = list(map(index.get, keys))
        new = list(dict.fromkeys([k for k, r in zip(keys, got) if r is None]))
        if not new:
            return got  # type: ignore[return-value]  # every key is indexed
        first = len(self.requests)
        index.update(zip(new, range(first, first + len(new))))
        ids, tenants = zip(*new)
        self.requests.extend(ids)
        self.request_tenants.extend(tenants)
        named = self.named
        self.tenant_since.extend([_NEVER if k[1] is None else named.get(k, _NEVER) for k in new])
        return list(map(index.__getitem__, keys))
