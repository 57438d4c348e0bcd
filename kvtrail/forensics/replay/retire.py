"""Retirement: what a long-running replay forgets, so that it holds what is live and not all it has seen.

An online replay (:class:`~kvtrail.forensics.online.OnlineReplay`) is fed a store as it grows for as long as
the service runs. Without retirement its state grows with every request id it has seen (the request's
index, tenant, naming order, and the cross-node joins' transfers, responses, receipts, aborts and hits)
and with every forward write (a prefill-rate sample). :class:`Retirement` bounds both:

* A request id retires once the history's wall time (its newest event) has moved ``horizon_ns`` past the
  id's newest event, no page of any pool names one of its requests (holder, last allocation, last writer,
  extra or prefix-cache holder, a late write's victim), and every request it shares a bootstrap room with
  (a transfer id of the cluster) retires too. Its cross-node findings (F2, F3, F4, F9, F11) are kept as they
  were last derived (``frozen``), then everything the replay holds for it is dropped; its index slot stays
  (the page arrays name requests by index), emptied, until the emptied slots outnumber the others: then
  the indices are compacted (every page array, extra and prefix-cache holder, late write, released list
  and the fast path's tenant arrays renumbered, in order), so the slots too are bounded by what is live.
* Each node keeps its latest ``samples`` prefill-rate samples, and a node that is not a prefill node its
  latest ``deferred`` forward writes (sampled should it become one); forward writes already taken into
  samples are dropped. A retired request's samples
  stay; an aborted one's are removed for good before its abort is forgotten.

What this changes, and only for events the horizon has passed (``docs/service.md``, "Memory"): an event of a
retired request id is judged as the first event of a new request (its tenant, transfers, responses and
aborts before are forgotten); a retired request's F9 is judged against its node's rate at retirement; a
node with more forward writes than ``samples`` has its rate taken over its latest ``samples``. Histories
whose requests keep within the horizon and whose nodes stay under ``samples`` writes are judged exactly as
a replay of the whole store judges them. Retirement assumes events are fed in the engine's order (an
online replay's case): a sample, once taken, is final.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrail.forensics.findings import Finding
from kvtrail.forensics.replay.batch import JOIN_CODES
from kvtrail.forensics.replay.pagestate import PageState
from kvtrail.forensics.replay.shares import PrefixShares
from kvtrail.forensics.replay.state import _NEVER, ReplayState

if TYPE_CHECKING:
    from kvtrail.forensics.replay.fast import FastReplay

# Wall time of the history a request id is kept after its newest event (the model's monitors keep the same).
HORIZON_NS = 600 * 1_000_000_000
# Prefill-rate samples kept per node: the latest ones.
RATE_SAMPLES = 1 << 16
# Emptied index slots are compacted away once they number this many and more than the live ones.
COMPACT_FLOOR = 1 << 12
# Forward writes kept per node that is not a prefill node (sampled should it become one): the latest ones.
DEFERRED_WRITES = 1 << 12


class Retirement:
    """Tracks each request id's newest event and retires ids the horizon has passed (:meth:`retire`)."""

    def __init__(
        self,
        horizon_ns: int = HORIZON_NS,
        samples: int = RATE_SAMPLES,
        deferred: int = DEFERRED_WRITES,
        compact_floor: int = COMPACT_FLOOR,
    ):
        self.horizon_ns = horizon_ns
        self.samples = samples
        self.deferred = deferred
        self.compact_floor = compact_floor
        self.newest_ns = 0  # the history's wall time: its newest event
        self.last_seen: dict[str, int] = {}  # request id -> wall_ns of its newest event
        self.frozen: list[Finding] = []  # cross-node findings of retired requests, as last derived
        self.retired = 0  # request ids retired so far
        self.samples_dropped = 0  # rate samples and deferred writes dropped past ``samples`` per node
        self.compactions = 0  # times the request indices were renumbered
        self._emptied: list[int] = []  # index slots emptied since the last compaction
        self.late_events = 0  # events fed older than the horizon (their request ids may have been retired)
        self._retired_at_ns = 0

    def seen(self, table: pa.Table) -> None:
        """Note the request ids of ``table`` and its newest event."""
        if not table.num_rows:
            return
        wall = table.column("wall_ns")
        oldest, newest = (x.as_py() for x in pc.min_max(wall).values())
        if newest is None:
            return
        if not self._retired_at_ns:
            self._retired_at_ns = oldest  # the first retirement a quarter horizon into the history
        in_order = newest >= self.newest_ns  # then no id was seen later than this table's newest event
        self.newest_ns = max(self.newest_ns, newest)
        if self.retired:
            self.late_events += pc.sum(pc.less(wall, self.newest_ns - self.horizon_ns)).as_py() or 0
        last = self.last_seen
        pairs: Iterable[tuple[str | None, int]]
        if newest - oldest > self.horizon_ns // 4:  # a long table (the store read at start): each id's own newest
            got = table.select(["request_id", "wall_ns"]).group_by("request_id").aggregate([("wall_ns", "max")])
            pairs = zip(got.column("request_id").to_pylist(), got.column("wall_ns_max").to_pylist())
        else:  # a commit: every id as of its newest event (later than its own by at most the commit's span)
            ids = pc.unique(table.column("request_id")).drop_null().to_pylist()
            if in_order:
                last.update(dict.fromkeys(ids, newest))
                return
            pairs = ((rid, newest) for rid in ids)
        for rid, at in pairs:
            if rid is not None and last.get(rid, -1) < at:
                last[rid] = at

    def due(self) -> bool:
        """Whether the history has moved on by a quarter of the horizon since the last retirement."""
        return self.newest_ns - self._retired_at_ns >= self.horizon_ns // 4

    def retire(self, state: ReplayState, found: list[Finding], fast: FastReplay | None = None) -> int:
        """Retire the request ids the horizon has passed; ``found``: the replay's findings as just derived
        (its retired requests' cross-node ones are kept in ``frozen``); ``fast``: the engine's fast path
        (its tenant arrays follow a compaction). Returns the ids retired."""
        self._retired_at_ns = self.newest_ns
        cutoff = self.newest_ns - self.horizon_ns
        idle = {rid for rid, wall in self.last_seen.items() if wall < cutoff}
        if idle:
            idle -= {state.requests[r] for r in _named_by_pages(state).tolist()}
            idle = _whole_rooms(state, idle)
        if not idle:
            return 0
        self.frozen += [f for f in found if f.code in JOIN_CODES and f.request_id in idle]
        _forget_joins(state, idle)
        self._emptied += _forget_requests(state, idle)
        for rid in idle:
            del self.last_seen[rid]
        self.retired += len(idle)
        if len(self._emptied) >= max(self.compact_floor, len(state.requests) - len(self._emptied)):
            _compact(state, fast, self._emptied)
            self._emptied = []
            self.compactions += 1
        return len(idle)

    def bound_samples(self, state: ReplayState) -> None:
        """Drop the forward writes taken into samples, and each node's samples and deferred writes beyond
        the latest ``samples`` and ``deferred`` (after every derivation of the findings)."""
        j = state.joins
        if not j._samples_stale:  # taken writes are final (the engine's order): only those still to take stay
            del j.forward_writes[: j._samples_seen]
            j._samples_seen = 0
        for s in j._samples.values():
            extra = len(s.rates) - self.samples
            if extra > 0:
                del s.rates[:extra], s.rids[:extra]
                self.samples_dropped += extra
        for writes in j._deferred.values():
            extra = len(writes) - self.deferred
            if extra > 0:
                del writes[:extra]
                self.samples_dropped += extra


def _named_by_pages(state: ReplayState) -> np.ndarray:
    """The request indices some page of some pool names (its released lists aside: they serve only the
    request's own late writes)."""
    refs: list[np.ndarray] = []
    for pool in state.pools.values():
        refs += [np.asarray(pool.raw(name), np.int64).ravel() for name in ("owner", "alloc_req", "writer")]
        refs.append(np.fromiter((r for rs in pool.extra.values() for r in rs), np.int64))
        refs.append(_sharers(pool))
        refs.append(np.fromiter((v[1] for v in pool.late.values()), np.int64))
    if not refs:
        return np.zeros(0, np.int64)
    flat = np.concatenate(refs)
    return np.unique(flat[flat >= 0])


def _sharers(pool: PageState) -> np.ndarray:
    used = np.flatnonzero(pool.raw("nshared"))
    if not len(used):
        return np.zeros(0, np.int64)
    head = pool.raw("share_head")
    return np.fromiter((pool.shares.req[s] for e in used.tolist() for s in pool.shares.chain(head, e)), np.int64)


def _whole_rooms(state: ReplayState, idle: set[str]) -> set[str]:
    """``idle`` less the ids that share a transfer id of a cluster with an id not idle (a bootstrap room's
    two requests are judged together, so they retire together)."""
    rooms: dict[tuple[str, int], set[str | None]] = {}
    for cluster, tid, rid, _ in state.joins.transfers:
        if tid is not None:
            rooms.setdefault((cluster, tid), set()).add(rid)
    while True:
        keep = {rid for ids in rooms.values() if not ids <= idle for rid in ids if rid in idle}
        if not keep:
            return idle
        idle = idle - keep


def _forget_joins(state: ReplayState, idle: set[str]) -> None:
    """Drop what the cross-node joins hold for the ids ``idle`` (an aborted one's rate samples first)."""
    j = state.joins
    gone = {(nk, rid) for nk, rid in j.aborted_at if rid in idle}
    if gone:
        for nk, s in j._samples.items():
            keep = [k for k, rid in enumerate(s.rids) if (nk, rid) not in gone]
            if len(keep) != len(s.rids):
                s.rates[:] = [s.rates[k] for k in keep]
                s.rids[:] = [s.rids[k] for k in keep]
        for nk, writes in j._deferred.items():
            writes[:] = [w for w in writes if (nk, w[3]) not in gone]
        j.aborted_at -= gone
    _drop(j.transfers, lambda k: k[2] in idle)
    _drop(j._transfer_checks, lambda k: k[2] in idle)
    j.responses[:] = [r for r in j.responses if r.request_id not in idle]
    for rid in idle:
        j.aborts.pop(rid, None)
    _drop(j.receipts, lambda k: k[1] in idle)
    _drop(j.request_receipts, lambda k: k[1] in idle)
    _drop(j.hit_pages, lambda k: k[1] in idle)


def _drop(d: dict, gone: Callable[[Any], bool]) -> None:
    for k in [k for k in d if gone(k)]:
        del d[k]


def _forget_requests(state: ReplayState, idle: set[str]) -> list[int]:
    """Drop the ids ``idle`` from the replay's requests: their keys, tenants and naming orders; their index
    slots stay, emptied (no page names them, nor a key any longer): returned."""
    slots = []
    for key in [k for k in state.request_index if k[0] in idle]:
        r = state.request_index.pop(key)
        state.requests[r] = None
        state.request_tenants[r] = None
        state.tenant_since[r] = _NEVER
        slots.append(r)
    for pool in state.pools.values():  # their released lists serve only their own late writes
        for r in slots:
            lists = pool.released.pop(r, None)
            if lists:
                pool.released_pages -= sum(len(a) for a in lists)
    _drop(state.named, lambda k: k[0] in idle)
    for rid in idle:
        state.tenants.pop(rid, None)
    return slots


def _compact(state: ReplayState, fast: FastReplay | None, emptied: list[int]) -> None:
    """Renumber the request indices without the ``emptied`` slots, keeping their order, wherever one is held."""
    n = len(state.requests)
    alive = np.ones(n, np.bool_)
    alive[emptied] = False
    keep = np.flatnonzero(alive)
    remap = np.full(n + 1, -1, np.int64)  # index -1 (none) stays -1: the last entry
    remap[keep] = np.arange(len(keep))
    for pool in state.pools.values():
        for name in ("owner", "alloc_req", "writer"):
            arr = pool.raw(name)
            arr[...] = remap[arr]
        for p, rs in pool.extra.items():
            pool.extra[p] = {int(remap[r]) for r in rs}
        for p, (ev, w, g) in pool.late.items():
            pool.late[p] = (ev, int(remap[w]), g)
        released = [(int(remap[r]), lists) for r, lists in pool.released.items()]
        pool.released.clear()
        pool.released.update(released)
        hits = pool.shared()  # the prefix-cache holders are keyed by request: inserted again, in hit order
        if hits:
            pool.raw("share_head")[...] = -1
            pool.raw("nshared")[...] = 0
            pool.shares = PrefixShares(pool.shares.num_slots)
            for e, holders in hits.items():
                for r, h in holders.items():
                    pool.share(e, int(remap[r]), h)
    idx = keep.tolist()
    state.requests[:] = [state.requests[r] for r in idx]
    state.request_tenants[:] = [state.request_tenants[r] for r in idx]
    state.tenant_since[:] = [state.tenant_since[r] for r in idx]
    for rkey, r in state.request_index.items():
        state.request_index[rkey] = int(remap[r])
    state.renamed[:] = [int(remap[r]) for r in state.renamed if remap[r] >= 0]
    if fast is not None:
        m = len(fast.tenant_code)
        fast.tenant_code, fast.tenant_ord = fast.tenant_code[keep[keep < m]], fast.tenant_ord[keep[keep < m]]
