"""The live judge: the online replay tailing the service's store, persisting new findings as batches commit.

After each commit the ingest writer calls :meth:`Judge.notify` with the committed events; the judge's
thread then feeds them to one warm :class:`~kvtrail.forensics.OnlineReplay` (reading back from the store
only what it was not handed: at start, or after it fell more than ``MAX_HELD_EVENTS`` events or
``MAX_HELD_BYTES`` of them behind) and saves
what it reports with :func:`~kvtrail.forensics.save_findings` (and the poll's commits to the minute
aggregates) on its own cursor, beside the ingest writer rather than under its lock (the judge is the only
writer of those tables), so the ``findings`` table (stable ids, ``first_run_id``) is fresh without
re-running a window. Commits that arrive while a poll runs are judged by the next one, and polls are at
least ``poll_interval_s`` apart while batches stream in: each poll has fixed costs (the aggregates'
transaction, a pass over every 2xx response for F4 and F9), so polling on every commit would cost more
than the commits
(``wait_idle`` skips the wait). A failure
never reaches ingest: it is counted, logged and retried (findings a failed save did not persist are
saved by the next attempt). The lag from a commit to the end of the poll that judged it is kept for
``stats``.

At start the first poll judges everything the store already holds; findings stored by an earlier run
keep their ids and ``first_run_id``.

The same polls feed the model's monitors (:class:`~kvtrail.model.live.LiveMonitors`, its own watermark:
each committed batch fed once, the store read only for what it was not handed), so a property of
docs/model.md broken by a commit is a violation once the poll that judged it ends
(``kvtrail_model_violations_total``, the ``KvtrailModelViolation`` alert).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

import duckdb
import numpy as np
import pyarrow as pa

from kvtrail.audit.batch import from_dicts
from kvtrail.forensics import Finding, OnlineReplay
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.results import aggregates
from kvtrail.forensics.results.persist import save_findings
from kvtrail.model.live import LiveMonitors
from kvtrail.model.monitors import COLUMNS as MONITOR_COLUMNS
from kvtrail.service.config import DEFAULT_JUDGE_HORIZON_S, DEFAULT_JUDGE_INTERVAL_S

log = logging.getLogger("kvtrail.service")
ENGINE = "online"
_LAG_SAMPLES = 4096
# Committed events the judge holds for direct feeding; past either bound (events, or their Arrow bytes) it
# drops them and reads them from the store: a judge that lags holds at most this much of the stream.
MAX_HELD_EVENTS = 2_000_000
MAX_HELD_BYTES = 128 * 2**20
# The minute aggregates take the fed commits at most this often while commits keep coming (and at once when
# a poll finds no new commit, or the judge is waited for): adding them costs about the same for one commit as
# for twenty, and readers count the minutes not yet added from their events, so the dashboard loses nothing
# meanwhile. A judge that keeps up is idle between most polls, so "idle" means a whole poll with no commit.
AGGREGATE_INTERVAL_S = 2.0
_WARM_UP_PRODUCER = {
    "cluster": "warm-up",
    "node": "warm-up",
    "role": "decode",
    "engine": "kvtrail",
    "engine_version": "0",
    "instance": "0",
}
# Fed to a throwaway replay at start: loading the compiled kernels takes seconds on a loaded machine.
_WARM_UP_EVENTS = [
    {
        "schema_version": 1,
        "producer": _WARM_UP_PRODUCER,
        "seq": 0,
        "wall_ns": 1,
        "mono_ns": 1,
        "kind": "node_config",
        "pool_tokens": 64,
        "pool_pages": 4,
        "page_size": 16,
        "context_tokens": 64,
    },
    {
        "schema_version": 1,
        "producer": _WARM_UP_PRODUCER,
        "seq": 1,
        "wall_ns": 2,
        "mono_ns": 2,
        "kind": "pages_allocated",
        "request": {"request_id": "r", "tenant_id": "t"},
        "pages": [0, 1],
        "purpose": "prefill_extend",
    },
]
# After each poll that succeeded: (findings it saved, the committed event tables it was handed, every finding
# it holds); e.g. kvtrail.alerts.otel.OtelExport.judged. It must return at once; what it raises is logged only.
OnJudged = Callable[[list[Finding], list[pa.Table], list[Finding]], None]
POLL_INTERVAL_S = DEFAULT_JUDGE_INTERVAL_S  # least time between two polls while commits keep coming (bounds the lag)
# What the model's monitors read of a committed table beside the replay's columns: a commit is cut to both
# and sorted once (a group commit interleaves producers, and each reader would otherwise sort every column)
_MONITORED_COLUMNS = (*MONITOR_COLUMNS, "pages")


def _judged_rows(table: pa.Table) -> pa.Table:
    """A committed table as the judge's readers take it: their columns only, in engine order."""
    return OnlineReplay.in_feed_order(table, _MONITORED_COLUMNS)


class Judge:
    """One thread judging a store as it grows. ``cursor`` makes the connection it reads and saves through."""

    def __init__(
        self,
        cursor: Callable[[], duckdb.DuckDBPyConnection],
        *,
        policy: ForensicsPolicy = ForensicsPolicy(),
        retry_s: float = 1.0,
        poll_interval_s: float = POLL_INTERVAL_S,
        on_judged: OnJudged | None = None,
        horizon_ns: int = DEFAULT_JUDGE_HORIZON_S * 1_000_000_000,
    ):
        self.policy = policy
        self.on_judged = on_judged
        self.retry_s = retry_s
        self.poll_interval_s = poll_interval_s
        # what the replay and the monitors hold is bounded by the requests within the horizon (docs/service.md)
        self.replay = OnlineReplay(policy, horizon_ns)
        self.model = LiveMonitors(horizon_ns)  # the model's properties as monitors (docs/model.md)
        self.last_run_id: int | None = None  # the forensic run of the judge's latest save
        self.polls = 0
        # CPU seconds the judge's thread spent in its polls (replay, monitors, saving findings, minute
        # aggregates; not the kernels' warm-up at start): what judging costs the service, beside ingest
        self.cpu_s = 0.0
        self.failures = 0
        self.findings_saved = 0
        self.lag_s: deque[float] = deque(maxlen=_LAG_SAMPLES)  # commit -> judged and persisted, per poll
        self._con = cursor()
        self._unsaved: list[Finding] = []
        self._held: list[tuple[pa.Table, dict[int, int]]] = []  # committed, not yet fed, in commit order
        self._held_events = self._held_bytes = 0
        self.dropped_held = 0  # times the held commits passed a bound and were left to the store
        self.fed_direct = 0  # batches fed as committed, not read back
        # The per-(node, minute) aggregates: counted from each handed batch; rebuilt where the judge read
        # batches back from the store instead (its first poll, a fallback, a failed poll).
        self._refresh_aggregates = True
        self._agg_pending: list[tuple[pa.Table, dict[int, int]]] = []  # fed, not yet in the aggregates
        self._agg_at = 0.0
        # Whether the next poll reads new batches from the store: at start (what it already holds), after
        # commits it was not handed (or dropped, or a failed poll). Otherwise every committed batch reaches
        # the judge through notify, and a poll reading the store would race ahead of the notifications:
        # it would read batches committed since it took them, and rebuild their minutes' aggregates.
        self._read_store = True
        self._cv = threading.Condition()
        self._oldest_ns: int | None = None  # monotonic time of the oldest commit not yet judged
        self._busy = False
        self._stopping = False
        self._hurry = 0  # wait_idle callers: poll without waiting out the interval
        self._replay_lock = threading.Lock()  # the replay is fed by the thread and read by judged()
        self._judged: tuple[dict[int, int], list[Finding]] | None = None
        self._thread = threading.Thread(target=self._run, name="kvtrail-service-judge", daemon=True)
        self._thread.start()

    def notify(
        self, committed_ns: int | None = None, table: pa.Table | None = None, batches: dict[int, int] | None = None
    ) -> None:
        """A commit at ``committed_ns`` (monotonic; now if None) stored ``batches`` ({producer_id: batch_no},
        events ``table``): judge it soon. Without a table the judge reads what is new from the store."""
        t = time.monotonic_ns() if committed_ns is None else committed_ns
        with self._cv:
            if self._oldest_ns is None or t < self._oldest_ns:
                self._oldest_ns = t
            if table is not None and batches:
                self._held.append((table, dict(batches)))
                self._held_events += table.num_rows
                self._held_bytes += table.nbytes
                if self._held_events > MAX_HELD_EVENTS or self._held_bytes > MAX_HELD_BYTES:
                    # fell behind: let the store hold them
                    self._held, self._held_events, self._held_bytes, self._read_store = [], 0, 0, True
                    self.dropped_held += 1
            elif batches is None or table is None:
                self._read_store = True  # a commit it was not handed: the next poll reads the store
            self._cv.notify_all()

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Block until every commit notified so far is judged (and its findings saved); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            self._hurry += 1
            self._cv.notify_all()
            try:
                while self._oldest_ns is not None or self._busy or self._unsaved or self._agg_pending:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._thread.is_alive():
                        return False
                    self._cv.wait(left)
            finally:
                self._hurry -= 1
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Judge what is pending (bounded by ``timeout_s``), stop the thread and release the cursor."""
        self.wait_idle(timeout_s)
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._con.close()

    def judged(self, at_least: dict[int, int], timeout_s: float = 5.0) -> tuple[dict[int, int], list[Finding]] | None:
        """What the judge holds once it has judged at least the batches ``at_least`` ({producer_id: batch_no},
        e.g. the store's heads when a query came): the batches judged and every finding the replay derives
        from them, in ``ReplayEngine.findings`` order (derived once per poll, under the replay's lock, so
        the two agree). None if the judge has not caught up within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        mark = self.replay.tail.watermark
        with self._cv:  # no hurry: questions wait for the next poll, so those asked meanwhile share its snapshot
            while any(mark.get(pid, -1) < no for pid, no in at_least.items()):
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return None
                self._cv.wait(left)
        with self._replay_lock:
            if self._judged is None:
                self._judged = (dict(self.replay.tail.watermark), list(self.replay.found))
            return self._judged

    def stats(self) -> dict[str, float | int | None]:
        """Counters and the lag's percentiles (seconds) over the latest polls."""
        lags = np.array(self.lag_s) if self.lag_s else None
        return {
            "polls": self.polls,
            "cpu_s": self.cpu_s,
            "failures": self.failures,
            "findings_saved": self.findings_saved,
            "batches_fed_direct": self.fed_direct,
            "held_dropped": self.dropped_held,
            "events_judged": self.replay.num_events,
            "last_run_id": self.last_run_id,
            "requests_retired": self.replay.retirement.retired,
            "events_past_horizon": self.replay.retirement.late_events,
            "lag_p50_s": None if lags is None else float(np.percentile(lags, 50)),
            "lag_p99_s": None if lags is None else float(np.percentile(lags, 99)),
            "lag_max_s": None if lags is None else float(lags.max()),
        }

    # ---- the judge's thread ----------------------------------------------------------------------

    def _pending(self) -> bool:
        """Whether a poll has something to do: commits to judge, findings to save or aggregates to add."""
        return self._oldest_ns is not None or bool(self._unsaved) or bool(self._agg_pending)

    def _run(self) -> None:
        if self.replay.engine.fast_path is not None:  # load the compiled kernels now, not on the first commit
            OnlineReplay(self.policy).engine.feed(from_dicts(_WARM_UP_EVENTS))
        next_poll = 0.0
        while True:
            with self._cv:
                while not self._stopping and (not self._pending() or not self._hurry and time.monotonic() < next_poll):
                    self._cv.wait(None if not self._pending() else max(0.0, next_poll - time.monotonic()))
                if self._stopping:
                    return
                next_poll = time.monotonic() + self.poll_interval_s
                since, self._oldest_ns = self._oldest_ns, None
                held, self._held, self._held_events, self._held_bytes = self._held, [], 0, 0
                read_store, self._read_store = self._read_store, False
                self._busy = True
            cpu0 = time.thread_time()
            ok = self._poll(held, read_store)
            self.cpu_s += time.thread_time() - cpu0
            with self._cv:
                self._busy = False
                if ok and since is not None:
                    self.lag_s.append((time.monotonic_ns() - since) / 1e9)
                elif not ok and since is not None and (self._oldest_ns is None or since < self._oldest_ns):
                    self._oldest_ns = since  # judged again by the retry
                self._cv.notify_all()
                if not ok:
                    self._cv.wait(self.retry_s)

    def _poll(self, held: list[tuple[pa.Table, dict[int, int]]], read_store: bool) -> bool:
        try:
            fed: list[tuple[pa.Table, dict[int, int]]] = []
            rows = [_judged_rows(table) for table, _ in held]  # sorted once for the replay and the monitors
            with self._replay_lock:
                self._judged = None
                before = self.replay.num_events
                for (table, batches), judged in zip(held, rows):
                    if not self.replay.feed_committed(self._con, judged, batches, ordered=True):
                        read_store = True  # not the next batches: read them (and what follows) from the store
                        break
                    self.fed_direct += len(batches)
                    fed.append((table, batches))
                self._unsaved += self.replay.poll(self._con, read_store=read_store)
                read_back = self.replay.num_events - before != sum(t.num_rows for t, _ in fed)
            self.polls += 1
            # Not under the service's write lock: the judge is the only writer of these tables (findings,
            # forensic runs, the minute aggregates), each write is its own transaction on its own cursor,
            # and DuckDB commits it beside the ingest writer's; holding the lock would stall ingest.
            saved = self._unsaved
            if self._unsaved:
                record = save_findings(
                    self._con,
                    self._unsaved,
                    from_ns=None,
                    to_ns=None,
                    engine=ENGINE,
                    policy=self.policy,
                    recompute_aggregates=False,
                )
                self.last_run_id = record.run_id
                self.findings_saved += record.num_new
                self._unsaved = []
            self._agg_pending += fed
            if self._refresh_aggregates or read_back:  # counts every minute not counted, the pending ones too
                aggregates.refresh(self._con)
                self._agg_pending, self._agg_at = [], time.monotonic()
            elif self._agg_pending and (
                self._hurry or not held or time.monotonic() - self._agg_at >= AGGREGATE_INTERVAL_S
            ):
                aggregates.add_batches(self._con, self._agg_pending)  # one transaction for them all
                self._agg_pending, self._agg_at = [], time.monotonic()
            self._refresh_aggregates = False
            # after the findings are saved: the model's monitors never hold them up
            model_reads = read_store
            for (_, batches), judged in zip(held, rows):
                if not self.model.feed_committed(judged, batches, ordered=True):
                    model_reads = True
                    break
            self.model.poll(self._con, read_store=model_reads)
        except Exception:  # noqa: BLE001 - the judge must outlive any failure; counted, logged, retried
            self._refresh_aggregates = True
            self._agg_pending = []  # the refresh of the retry counts them
            self.failures += 1
            with self._cv:
                self._read_store = True  # what this poll took is judged again from the store
            log.exception("kvtrail service: live judge failed (retried in %.1f s)", self.retry_s)
            return False
        if self.on_judged is not None:
            try:
                self.on_judged(saved, [t for t, _ in fed], self.replay.found)
            except Exception:  # noqa: BLE001 - a listener never fails the poll
                log.exception("kvtrail service: the live judge's listener failed")
        return True
