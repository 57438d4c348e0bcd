"""Streaming replay of page ownership: audit events in, F1-F11 findings out.

:class:`ReplayEngine` walks events in time order and keeps, per node pool, a
:class:`~kvtrail.forensics.replay.pagestate.PageState`: numpy arrays indexed by page id (the exclusive holder,
who last wrote the page - request, time, digest, block hash, event -, a generation counter bumped on
every allocation). All it knows lives in one :class:`~kvtrail.forensics.replay.state.ReplayState`, which
it hands to the Python handlers (:mod:`kvtrail.forensics.replay.handlers`, where the rules are) and to
the compiled fast path (:mod:`kvtrail.forensics.replay.fast`).

Page findings (F1, F5, F6, F7, F10) and F8 are derived as events arrive; F2, F3, F4 and F9 join events
across nodes (:mod:`kvtrail.forensics.replay.joins`) and are derived when :meth:`ReplayEngine.findings` is
called, so the order in which different nodes' events arrive does not matter.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrail.audit.store import read_events
from kvtrail.forensics.findings import UNVERIFIED, Finding
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.replay.batch import (
    JOIN_CODES,
    JOIN_KINDS,
    PAGE_KINDS,
    PRODUCER_NAMES,
    ReplayBatch,
    codes_of,
    flat_list,
    from_table,
    in_engine_order,
    request_codes,
)
from kvtrail.forensics.replay.event import SCALARS, ReplayEvent
from kvtrail.forensics.replay.handlers import EventHandlers
from kvtrail.forensics.replay.joins import CrossNodeJoins
from kvtrail.forensics.replay.state import ReplayState
from kvtrail.forensics.window import window_filter

if TYPE_CHECKING:
    from kvtrail.forensics.replay.fast import FastReplay

_SEQ = SCALARS.index("seq")


def fast_by_default() -> bool:
    """Whether a ReplayEngine made without ``fast`` takes the compiled fast path (numba installed)."""
    return importlib.util.find_spec("numba") is not None


class ReplayEngine:
    """Replays audit events (wire-shaped Arrow batches, in time order) and collects findings.

    ``producer_ids`` maps a producer identity tuple (cluster, node, role, engine, engine_version,
    instance) to its store id, so evidence names stored events; unknown producers get fresh ids.
    ``policy`` decides F9's thresholds and whether cross-tenant prefix sharing is a finding (F10).
    ``codes``: the findings wanted (default all); without F2/F3/F4/F9 the cross-node joins are skipped.
    ``fast``: replay finding-free page events in compiled runs (:mod:`kvtrail.forensics.replay.fast`,
    needs numba); None uses it when numba is installed; False replays every event in Python (the
    reference the fast path is tested against).
    """

    def __init__(
        self,
        producer_ids: dict[tuple, int] | None = None,
        policy: ForensicsPolicy = ForensicsPolicy(),
        *,
        codes: Iterable[str] | None = None,
        fast: bool | None = None,
    ):
        self.producer_ids = dict(producer_ids or {})
        self.policy = policy
        self.codes = None if codes is None else frozenset(codes)
        self.need_joins = self.codes is None or bool(self.codes & JOIN_CODES)
        self._next_pid = max(self.producer_ids.values(), default=-1) + 1
        self.state = ReplayState(CrossNodeJoins(policy))
        self.handlers = EventHandlers(self.state, policy)
        self.fast_path: FastReplay | None = None
        if fast or (fast is None and fast_by_default()):
            from kvtrail.forensics.replay.fast import FastReplay  # numba is imported only when used

            self.fast_path = FastReplay(self.state, self.handlers, self.need_joins)

    # ---- input -------------------------------------------------------------------------------------

    def feed(self, table: pa.Table, *, ordered: bool = False) -> None:
        """Replay one batch; rows are taken in (wall_ns, cluster, node, instance, seq) order (``ordered``:
        the caller sorted them so, with :func:`~kvtrail.forensics.replay.batch.in_engine_order`)."""
        if table.num_rows == 0:
            return
        if not ordered:
            table = in_engine_order(table)
        if self.fast_path is not None:
            self.fast_path.feed(from_table(table, self._producer_id))
            return
        state = self.state
        is_page_event = codes_of(table.column("kind"), PAGE_KINDS) >= 0
        ord0 = state.take_ords(table.num_rows)
        state.register_requests(
            is_page_event, *request_codes(table.column("request_id")), table.column("tenant_id"), ord0
        )
        state.renamed.clear()  # only the fast path's tenant arrays follow them
        rows = zip(*(table.column(name).to_pylist() for name in SCALARS))
        ident = list(zip(*(table.column(n).to_pylist() for n in PRODUCER_NAMES)))
        pids = table.column("producer_id").to_pylist() if "producer_id" in table.column_names else None
        pages, poff = flat_list(table.column("pages"), np.int64)
        digests, doff = flat_list(table.column("page_digests"), np.uint64)
        hashes, hoff = flat_list(table.column("block_hashes"), np.int64)
        ndst = pc.fill_null(pc.list_value_length(table.column("dst_pages")), 0).to_pylist()
        roles, handle, make = state.joins.role, self.handlers.handle, ReplayEvent._make
        for i, vals in enumerate(rows):
            who = ident[i]
            node_key = (who[0], who[1])
            roles[node_key] = who[2]
            pid = pids[i] if pids is not None else self._producer_id(who)
            ev = make(
                (
                    *vals,
                    node_key,
                    who[5],
                    (pid, vals[_SEQ]),
                    ord0 + i,
                    pages[poff[i] : poff[i + 1]],
                    digests[doff[i] : doff[i + 1]] if doff[i + 1] > doff[i] else None,
                    hashes[hoff[i] : hoff[i + 1]] if hoff[i + 1] > hoff[i] else None,
                    ndst[i],
                )
            )
            if not self.need_joins and ev.kind in JOIN_KINDS and ev.status != UNVERIFIED:
                continue  # an unverified receipt changes page state (its pages' writer becomes unknown)
            handle(ev)

    def feed_batch(self, batch: ReplayBatch) -> None:
        """Replay a batch already in engine order (the fast path's input, e.g. read straight from a store)."""
        if self.fast_path is None:
            raise ValueError("feed_batch: needs the fast path (ReplayEngine(fast=True), numba installed)")
        self.fast_path.feed(batch)

    def _producer_id(self, ident: tuple) -> int:
        if ident not in self.producer_ids:
            self.producer_ids[ident] = self._next_pid
            self._next_pid += 1
        return self.producer_ids[ident]

    # ---- output ------------------------------------------------------------------------------------

    def findings(self) -> list[Finding]:
        """All findings so far, ordered by (last_ns, first_ns, code, evidence)."""
        joined: list[Finding] = []
        self.state.joins.evaluate(lambda code, ev, **kw: joined.append(self.handlers.finding(code, ev, **kw)))
        out = [f for f in self.state.found + joined if self.codes is None or f.code in self.codes]
        return sorted(out, key=lambda f: (f.last_ns, f.first_ns, int(f.code[1:]), f.evidence))


def replay_store(
    con,
    from_ns: int | None = None,
    to_ns: int | None = None,
    policy: ForensicsPolicy = ForensicsPolicy(),
    *,
    codes=None,
    fast: bool | None = None,
    read_ahead: bool = True,
) -> list[Finding]:
    """Findings of the events in [from_ns, to_ns] of an audit store (a DuckDB connection).

    Each producer is replayed from its last ``node_config`` at or before ``from_ns`` so page state at
    the window's start is known; findings that end before ``from_ns`` are left out. ``codes`` and
    ``fast`` are :class:`ReplayEngine`'s; ``read_ahead``: the fast path reads the next slice of the
    store while it replays one (:func:`~kvtrail.forensics.replay.source.store_batches`).
    """
    where, params = window_filter(from_ns, to_ns)
    rows = con.execute(f"SELECT producer_id, {', '.join(PRODUCER_NAMES)} FROM producers").fetchall()
    engine = ReplayEngine({tuple(r[1:]): r[0] for r in rows}, policy, codes=codes, fast=fast)
    if engine.fast_path is not None:  # read in engine order, in bounded slices, straight into the fast path
        from kvtrail.forensics.replay.kernels import warm_up
        from kvtrail.forensics.replay.source import store_batches

        for batch in store_batches(con, where, params, meanwhile=warm_up, read_ahead=read_ahead):
            engine.feed_batch(batch)
    else:
        engine.feed(read_events(con, where, params))
    found = engine.findings()
    return [f for f in found if from_ns is None or f.last_ns >= from_ns]
