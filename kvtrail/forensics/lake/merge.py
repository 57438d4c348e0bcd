"""The second stage: what crosses partitions, resolved from every task's result.

Per-node findings (F1, F5, F6, F7, F8, F10) come from the tasks as they are. The cross-node joins
(F2/F3/F4/F9/F11: transfers per request and bootstrap room, aborts against 2xx responses, TTFT against
each prefill node's measured rate) are rebuilt in one :class:`~kvtrail.forensics.replay.joins.CrossNodeJoins`
from the tasks' collections, in the order one store's replay would have fed them: the engine's order is
(wall time, cluster, node, ...), a task's own order numbers break ties inside its node, so each event is
renumbered by its place in that order before the joins are evaluated.
"""

from __future__ import annotations

from typing import Iterable, TypeVar

from kvtrail.forensics.findings import Finding
from kvtrail.forensics.lake.task import PartitionResult
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.replay.event import ReplayEvent
from kvtrail.forensics.replay.handlers import EventHandlers
from kvtrail.forensics.replay.joins import CrossNodeJoins
from kvtrail.forensics.replay.state import ReplayState
from kvtrail.forensics.replay.transfers import TransferEvents

K = TypeVar("K")


def _key(ev: ReplayEvent) -> tuple:
    return (ev.wall_ns, ev.node_key, ev.ord)


class _Renumber:
    """Global order numbers for the events of all tasks (one store's replay order)."""

    def __init__(self, results: list[PartitionResult]):
        keys: set[tuple] = set()
        for r in results:
            j = r.joins
            if j is None:
                continue
            for ev in _events_of(j):
                keys.add(_key(ev))
            keys.update((w[2], w[0], w[1]) for w in j.forward_writes)
        self.rank = {k: i for i, k in enumerate(sorted(keys))}

    def ev(self, ev: ReplayEvent) -> ReplayEvent:
        return ev._replace(ord=self.rank[_key(ev)])


def _events_of(j: CrossNodeJoins) -> Iterable[ReplayEvent]:
    for t in j.transfers.values():
        # with the node_config in force at each leg: a task replaying several hours (or a node configured
        # twice in an hour) may have had another config in force there than the latest it saw
        yield from (e for e in (t.reserved, t.received, t.reserved_cfg, t.received_cfg) if e is not None)
        yield from t.sent
    for evs in j.aborts.values():
        yield from evs
    yield from j.responses
    yield from j.receipts.values()
    yield from j.request_receipts.values()
    yield from j.configs.values()


def _earliest(into: dict[K, ReplayEvent], receipts: dict[K, ReplayEvent], num: _Renumber) -> None:
    """Add ``receipts`` to ``into``, renumbered: per key, the earliest in the engine's order."""
    for key, ev in receipts.items():
        ev = num.ev(ev)
        cur = into.get(key)
        if cur is None or ev.ord < cur.ord:
            into[key] = ev


def first_tenants(results: list[PartitionResult]) -> dict[str, str]:
    """Each request id's first tenant named, in hour order (as one store's replay names them): ``results``
    sorted by (first hour, cluster, node), an id a group of hours first named in a later hour counted at
    that hour (:attr:`~kvtrail.forensics.lake.task.PartitionResult.tenant_hours`)."""
    named = []
    for i, r in enumerate(results):
        for k, (rid, tenant) in enumerate(r.tenants.items()):
            named.append(((r.tenant_hours.get(rid, r.hours[0]), r.cluster, r.node, i, k), rid, tenant))
    named.sort(key=lambda n: n[0])
    out: dict[str, str] = {}
    for _, rid, tenant in named:
        out.setdefault(rid, tenant)
    return out


def merge_joins(results: list[PartitionResult], policy: ForensicsPolicy, tenants: dict[str, str]) -> CrossNodeJoins:
    """One CrossNodeJoins holding every task's collections, renumbered into one order; ``tenants``: the
    first tenant named for each id (:func:`first_tenants`), which the joins resolve unnamed events by."""
    results = sorted(results, key=lambda r: (r.hours[0], r.cluster, r.node))
    num = _Renumber(results)
    out = CrossNodeJoins(policy)
    out.tenants = tenants
    # Each task's latest node_config per node: a task that starts from a checkpoint has fed none, so the
    # config in force at one of its events is the latest one before it in any task (F11).
    configs: dict[tuple[str, str], list[ReplayEvent]] = {}
    for r in results:
        for ev in r.joins.configs.values() if r.joins is not None else ():
            configs.setdefault(ev.node_key, []).append(num.ev(ev))
    for evs in configs.values():
        evs.sort(key=lambda e: e.ord)
        out.configs[evs[-1].node_key] = evs[-1]

    def in_force(ev: ReplayEvent, cfg: ReplayEvent | None) -> ReplayEvent | None:
        if cfg is not None:
            return num.ev(cfg)
        before = [c for c in configs.get(ev.node_key, ()) if c.ord < ev.ord]
        return before[-1] if before else None

    for r in results:
        j = r.joins
        if j is None:
            continue
        for tkey, t in j.transfers.items():
            m = out.transfers.setdefault(tkey, TransferEvents())
            for name in ("reserved", "received"):  # the latest in the engine's order wins
                ev = getattr(t, name)
                if ev is not None:
                    ev = num.ev(ev)
                    cur = getattr(m, name)
                    if cur is None or ev.ord > cur.ord:
                        setattr(m, name, ev)
                        setattr(m, f"{name}_cfg", in_force(ev, getattr(t, f"{name}_cfg")))
            m.sent.extend(num.ev(e) for e in t.sent)
        for rid, evs in j.aborts.items():
            out.aborts.setdefault(rid, []).extend(num.ev(e) for e in evs)
        out.aborted_at |= j.aborted_at
        out.responses.extend(num.ev(e) for e in j.responses)
        _earliest(out.receipts, j.receipts, num)
        _earliest(out.request_receipts, j.request_receipts, num)
        out.forward_writes.extend((w[0], num.rank[(w[2], w[0], w[1])], w[2], w[3], w[4]) for w in j.forward_writes)
        for hkey, n in list(j.hit_pages.items()) + list(r.hit_pages.items()):
            out.hit_pages[hkey] = out.hit_pages.get(hkey, 0) + n
        out.page_size.update(j.page_size)  # results in hour order: the latest configuration wins
        out.role.update(j.role)
    for t in out.transfers.values():
        t.sent.sort(key=lambda e: e.ord)
    for evs in out.aborts.values():
        evs.sort(key=lambda e: e.ord)
    out.responses.sort(key=lambda e: e.ord)
    return out


def merged_findings(
    results: list[PartitionResult],
    policy: ForensicsPolicy,
    codes: Iterable[str] | None,
    from_ns: int | None,
    *,
    need_joins: bool,
) -> list[Finding]:
    """Every finding of the window, as :func:`kvtrail.forensics.replay.engine.replay_store` returns them."""
    ordered = sorted(results, key=lambda r: (r.hours[0], r.cluster, r.node))
    state = ReplayState(CrossNodeJoins(policy))
    state.tenants.update(first_tenants(ordered))
    handlers = EventHandlers(state, policy)
    found = [f for r in ordered for f in r.found]
    if need_joins:
        joins = merge_joins(ordered, policy, state.tenants)
        joins.evaluate(lambda code, ev, **kw: found.append(handlers.finding(code, ev, **kw)))
    wanted = None if codes is None else frozenset(codes)
    out = [f for f in found if wanted is None or f.code in wanted]
    out.sort(key=lambda f: (f.last_ns, f.first_ns, int(f.code[1:]), f.evidence))
    return [f for f in out if from_ns is None or f.last_ns >= from_ns]
