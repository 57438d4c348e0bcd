"""The model's monitors kept warm across commits: the service's live judge feeds each committed batch once.

:class:`LiveMonitors` holds one :class:`~kvtrail.model.monitors.Monitors` and its own per-producer
``batch_no`` watermark over the store (a :class:`~kvtrail.forensics.online.StoreTail`), so batches the
caller hands over as they commit are fed without reading them back, and the store is read only for what
it was not handed (at start, after a gap). Nothing is validated twice: each batch is fed once, in the
judge's order within its commit; the monitors depend only on each node's own order (docs/model.md).

What it keeps is bounded by the pools and the requests in flight: per node, three arrays indexed by page
id; per request seen within ``horizon_ns`` of wall time (or still named by a page), its code, tenant,
abort, reservation, receipt, sends and frees; the violations found (one per property, request and node)
and one count per "cannot tell" reason. ``prune`` runs when the history's wall time has moved on by a
quarter of the horizon.
"""

from __future__ import annotations

import threading

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from kvtrail.forensics.online import StoreTail
from kvtrail.model.monitors import Monitors, Violation, judge_order

# A request with no event for this long (wall time of the history) and no page naming it is forgotten; a
# write of it landing later is not seen as late. Far above any release timeout or transfer duration.
REQUEST_HORIZON_NS = 600 * 1_000_000_000


class LiveMonitors:
    """The monitors over a store as it grows; thread-safe readers (:meth:`counts`, :meth:`violations`)."""

    def __init__(self, horizon_ns: int = REQUEST_HORIZON_NS):
        self.monitors = Monitors()
        self.tail = StoreTail()
        self.horizon_ns = horizon_ns
        self.pruned = 0  # requests forgotten so far
        self.fed_direct = 0  # batches fed as handed over, not read back from the store
        self._newest_ns = 0
        self._pruned_at_ns = 0
        self._lock = threading.Lock()

    def feed_committed(self, table: pa.Table, batches: dict[int, int], *, ordered: bool = False) -> bool:
        """Feed batches just committed (``batches``: producer_id -> batch_no) if each is the next of its
        producer (True; True too when all were read already); else False and nothing is fed: the next
        :meth:`poll` with ``read_store`` reads them. ``ordered``: the rows already are in the judge's order
        (the caller sorted them), so they are not sorted again."""
        mark = self.tail.watermark
        if all(no <= mark.get(pid, -1) for pid, no in batches.items()):
            return True
        if any(no != mark.get(pid, -1) + 1 for pid, no in batches.items()):
            return False
        self.feed(table, ordered=ordered)
        mark.update(batches)
        self.fed_direct += len(batches)
        return True

    def poll(self, con: duckdb.DuckDBPyConnection, *, read_store: bool) -> None:
        """Read and feed what the store holds beyond the watermark (only with ``read_store``)."""
        table = self.tail.poll(con) if read_store else None
        if table is not None:
            self.feed(table)

    def feed(self, table: pa.Table, *, ordered: bool = False) -> None:
        """Feed one table of events (in the judge's order within it; ``ordered``: as it comes, already in
        that order), then prune if it is time."""
        if not table.num_rows:
            return
        order = None if ordered else judge_order(table)
        with self._lock:
            self.monitors.feed(table, order)
        newest = pc.max(table.column("wall_ns")).as_py()
        if newest is not None and newest > self._newest_ns:
            self._newest_ns = newest
        if self._newest_ns - self._pruned_at_ns >= self.horizon_ns // 4:
            with self._lock:
                self.pruned += self.monitors.prune(self._newest_ns - self.horizon_ns)
            self._pruned_at_ns = self._newest_ns

    def violations(self) -> list[Violation]:
        with self._lock:
            return list(self.monitors.violations)

    def counts(self) -> dict[tuple[str, str], int]:
        """Violations found so far, per (property, node)."""
        out: dict[tuple[str, str], int] = {}
        for v in self.violations():
            out[(v.property, v.node)] = out.get((v.property, v.node), 0) + 1
        return out

    def stats(self) -> dict[str, int]:
        """What the monitors hold: events fed, requests and nodes tracked, requests pruned, batches fed as
        handed over, violations."""
        with self._lock:
            m = self.monitors
            return {
                "events": m.events,
                "requests": len(m.codes),
                "nodes": len(m.pools),
                "pruned": self.pruned,
                "fed_direct": self.fed_direct,
                "violations": len(m.violations),
            }
