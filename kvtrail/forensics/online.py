"""Online forensics: the replay engine tailing a store, reporting findings as batches commit.

:class:`StoreTail` reads the events of batches committed since its last poll (a per-producer
``batch_no`` watermark, so nothing is read twice and nothing is skipped); :class:`OnlineReplay` feeds
them to one long-lived :class:`~kvtrail.forensics.replay.engine.ReplayEngine` and returns the findings not
reported before. Page findings are final when reported. Cross-node findings (F2, F3, F4, F9) are
re-judged on every poll and can be reported again with more evidence once the other node's batch
lands, so online answers are provisional; a window re-run (``replay_store``) is authoritative.

What the replay holds is bounded by what is live: request ids the history's wall time has left
``horizon_ns`` behind, and that no page names, are retired (their cross-node findings kept as last
derived), and each node keeps its latest prefill-rate samples (:mod:`kvtrail.forensics.replay.retire`
states what that changes for events older than the horizon).

Every poll takes the connection to read through, so a watcher in another process can open the file
read-only for one poll and close it again (DuckDB lets one process write a store file, and readers in
other processes only while no writer holds it); in the process that owns the store, pass
``AuditStore.cursor()``.
"""

from __future__ import annotations

import duckdb
import pyarrow as pa

from kvtrail.audit.events import PRODUCER_FIELDS
from kvtrail.audit.store import read_events
from kvtrail.forensics.findings import Finding
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.replay.batch import FEED_COLUMNS, in_engine_order
from kvtrail.forensics.replay.engine import ReplayEngine
from kvtrail.forensics.replay.retire import HORIZON_NS, Retirement
from kvtrail.forensics.results.persist import finding_id

_PRODUCER_NAMES = ", ".join(f.name for f in PRODUCER_FIELDS)


def _order(f: Finding) -> tuple:
    return (f.last_ns, f.first_ns, int(f.code[1:]), f.evidence)  # ReplayEngine.findings' order


class StoreTail:
    """Events of batches committed since the previous :meth:`poll` (all of them on the first)."""

    def __init__(self):
        self.watermark: dict[int, int] = {}  # producer_id -> last batch_no read
        self.producers: dict[tuple, int] = {}

    def poll(self, con: duckdb.DuckDBPyConnection) -> pa.Table | None:
        con.complete()
        heads = con.execute("SELECT producer_id, max(batch_no) FROM batches GROUP BY producer_id").fetchall()
        new = [(pid, head) for pid, head in heads if head > self.watermark.get(pid, -1)]
        if not new:
            return None
        self.producers = {
            tuple(r[1:]): r[0] for r in con.execute(f"SELECT producer_id, {_PRODUCER_NAMES} FROM producers").fetchall()
        }
        where = " OR ".join("(producer_id = ? AND batch_no > ? AND batch_no <= ?)" for _ in new)
        params = [x for pid, head in new for x in (pid, self.watermark.get(pid, -1), head)]
        table = read_events(con, where, params)
        self.watermark.update(new)
        return table


class OnlineReplay:
    """A replay engine kept warm across polls of a store; :meth:`poll` returns findings new since the last."""

    def __init__(self, policy: ForensicsPolicy = ForensicsPolicy(), horizon_ns: int = HORIZON_NS):
        self.tail = StoreTail()
        self.engine = ReplayEngine(policy=policy)
        self.retirement = Retirement(horizon_ns)
        self._reported: set[str] = set()
        self.num_events = 0
        self.found: list[Finding] = []  # every finding as of the last poll

    @staticmethod
    def in_feed_order(table: pa.Table, also: tuple[str, ...] = ()) -> pa.Table:
        """``table`` cut to the columns the replay reads (and ``also``, where it has them), in engine order:
        what :meth:`feed_committed` takes with ``ordered=True``. A caller with other readers of the same
        commit sorts it once here, for all of them."""
        keep = dict.fromkeys((*FEED_COLUMNS, *also))
        return in_engine_order(table.select([c for c in keep if c in table.column_names]))

    def feed_committed(
        self, con: duckdb.DuckDBPyConnection, table: pa.Table, batches: dict[int, int], *, ordered: bool = False
    ) -> bool:
        """Feed batches the caller just committed (``batches``: producer_id -> batch_no, one each; ``table``:
        their events as validated) without reading them back. Only when each is the next batch of its
        producer after what was read (or all were read already: True, nothing fed); else nothing is fed,
        False is returned, and :meth:`poll` reads them. ``ordered``: ``table`` is already in engine order
        (:meth:`in_feed_order`), so it is not sorted again.
        """
        if all(no <= self.tail.watermark.get(pid, -1) for pid, no in batches.items()):
            return True  # a poll already read them
        if any(no != self.tail.watermark.get(pid, -1) + 1 for pid, no in batches.items()):
            return False
        if not set(batches) <= set(self.engine.producer_ids.values()):  # a producer not yet known: its id
            self.tail.producers = {
                tuple(r[1:]): r[0]
                for r in con.execute(f"SELECT producer_id, {_PRODUCER_NAMES} FROM producers").fetchall()
            }
            self.engine.producer_ids.update(self.tail.producers)
        self.engine.feed(table, ordered=ordered)
        self.retirement.seen(table)
        self.num_events += table.num_rows
        self.tail.watermark.update(batches)
        return True

    def poll(self, con: duckdb.DuckDBPyConnection, *, read_store: bool = True) -> list[Finding]:
        """Read and feed the batches committed since the last poll (or feed); the findings new since then.

        ``read_store=False``: the caller fed every batch it knows of (:meth:`feed_committed`) and nothing
        is read. Either way :attr:`found` then holds every finding of what was fed, in
        ``ReplayEngine.findings`` order."""
        table = self.tail.poll(con) if read_store else None
        if table is not None:
            self.engine.producer_ids.update(self.tail.producers)  # evidence must name stored producer ids
            self.engine.feed(table)
            self.retirement.seen(table)
            self.num_events += table.num_rows
        found = self.engine.findings()
        frozen = self.retirement.frozen
        self.found = sorted(frozen + found, key=_order) if frozen else found
        self.retirement.bound_samples(self.engine.state)
        if self.retirement.due():
            self.retirement.retire(self.engine.state, found, self.engine.fast_path)
        out = []
        for f in self.found:
            fid = finding_id(f)
            if fid not in self._reported:
                self._reported.add(fid)
                out.append(f)
        return out
