"""Running a :class:`~kvtrail.sim.fleet.config.FleetConfig`: its batches, a store to write them to, and what
that store already holds of the simulated cluster.

:func:`fleet_batches` yields the simulated producers' batches (for feeding engines directly);
:func:`write_fleet` appends them to an :class:`~kvtrail.audit.store.AuditStore` through the normal
ingest path and writes the ground truth of what was planted. :func:`cluster_history` and
:func:`holds_run` tell whether a store already holds the cluster or the very same run.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pyarrow as pa

from kvtrail.audit.store import AuditStore
from kvtrail.sim.fleet.config import FleetConfig
from kvtrail.sim.fleet.loop import FleetSim

_S = 1_000_000_000


@dataclass(frozen=True)
class FleetSummary:
    """What one simulation produced (counts; the ground truth holds the details)."""

    producers: int
    events: int
    page_events: int  # entries of 'pages' lists
    requests: int
    responses: dict[str, int]  # HTTP status -> count
    plants: dict[str, int]  # class -> count
    affected: int
    from_ns: int
    to_ns: int
    elapsed_s: float


def fleet_batches(config: FleetConfig, truth: dict | None = None) -> Iterator[pa.Table]:
    """Yield the simulated producers' batches (BATCH_SCHEMA columns), one producer per batch.

    Batches of one producer come in ``seq`` order; batches of different producers interleave in
    the order they fill. When ``truth`` is a dict it is filled with the ground truth (see
    :meth:`kvtrail.sim.fleet.loop.FleetSim.truth`) once the generator is exhausted.
    """
    sim = FleetSim(config)
    yield from sim.batches()
    if truth is not None:
        truth.update(sim.truth())


def write_fleet(
    config: FleetConfig,
    store: AuditStore,
    truth_path: str | Path | None = None,
    progress: Callable[[int], None] | None = None,
) -> FleetSummary:
    """Simulate into ``store`` (an open AuditStore) through its normal ingest path; write the ground truth.

    Returns counts; the ground truth JSON goes to ``truth_path`` when given (one line: placeholder
    plants list tens of thousands of pages; ``jq .`` shows it indented). ``progress(n)`` is called
    with each stored batch's number of events.
    """
    t0 = time.perf_counter()
    sim = FleetSim(config)
    for table in sim.batches():
        store.append(table)
        if progress is not None:
            progress(table.num_rows)
    truth = sim.truth()
    if truth_path is not None:
        Path(truth_path).write_text(json.dumps(truth, separators=(",", ":")) + "\n")
    s = truth["summary"]
    return FleetSummary(
        producers=s["producers"],
        events=s["events"],
        page_events=s["page_events"],
        requests=s["requests"],
        responses=s["responses"],
        plants=s["plants"],
        affected=s["affected"],
        from_ns=truth["window"]["from_ns"],
        to_ns=truth["window"]["to_ns"],
        elapsed_s=time.perf_counter() - t0,
    )


@dataclass(frozen=True)
class ClusterHistory:
    """What a store already holds of one cluster: its producers and the wall time of its last stored batch."""

    producers: int
    last_wall_ns: int | None  # None: no batch stored (or no producer)

    @property
    def next_start_ns(self) -> int | None:
        """Where a run appended to this history starts: the whole second after its last event."""
        return None if self.last_wall_ns is None else (self.last_wall_ns // _S + 1) * _S


def cluster_history(store: AuditStore, cluster: str) -> ClusterHistory:
    """The producers and last stored wall time of ``cluster`` in ``store``."""
    row = store.con.execute(
        "SELECT count(DISTINCT p.producer_id), max(b.max_wall_ns) FROM producers p "
        "LEFT JOIN batches b USING (producer_id) WHERE p.cluster = ?",
        [cluster],
    ).fetchone()
    assert row is not None, "an aggregate query returns one row"
    return ClusterHistory(producers=int(row[0]), last_wall_ns=None if row[1] is None else int(row[1]))


def holds_run(store: AuditStore, config: FleetConfig) -> bool:
    """Whether ``store`` already holds producers of this very run (same cluster, start and seed)."""
    row = store.con.execute(
        "SELECT count(*) FROM producers WHERE cluster = ? AND instance = ?", [config.cluster, config.instance]
    ).fetchone()
    assert row is not None, "an aggregate query returns one row"
    return bool(row[0])
