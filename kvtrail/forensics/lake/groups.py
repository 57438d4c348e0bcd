"""Consecutive hours of one node as one task, where the cluster has fewer slots than the plan has tasks.

A ``pages`` task (:mod:`kvtrail.forensics.lake.plan`) replays one node's hour from the checkpoint at the
hour's start. Every task pays fixed costs besides its replay: restoring the checkpoint, reading the
lake's ``producers`` and ``batches`` files, a catalog, sizing its slices, registering its requests,
the scheduler's round trip. Where a question has many more partitions than the cluster has slots
(threads over all workers), :func:`group_tasks` joins runs of one node's consecutive ``pages`` tasks
into a :class:`TaskGroup`: :func:`run_group` restores only the first hour's checkpoint (or starts empty,
as that task would) and replays the hours in order with one engine, so each later hour continues from
the state one store's replay has there, which is what its checkpoint holds (each later checkpoint is
still checked against the manifest: a question never answers over an altered file). Consecutive hours
are read at once while they hold at most :data:`CHUNK_EVENTS` events (one catalog, slice sizing and reader
per chunk; a worker holds those rows, one slice's page lists and the node's page state), and the tables
every hour shares are read once.

How much is joined: a group holds at most :data:`MAX_GROUP_HOURS` hours (a day: what a worker that dies
costs to run again) and, on more than one slot, at most a ``1 / (TASKS_PER_SLOT * slots)`` share of the
plan's file bytes, so a cluster still gets several tasks per slot, largest first, and its workers finish
together. On one slot (tasks run one after another) a node's day is one task.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import islice
from typing import Sequence

from kvtrail.audit.lake.catalog import memory_catalog
from kvtrail.audit.lake.fs import LakeFS
from kvtrail.audit.lake.partition import HOUR_NS, hour_of
from kvtrail.forensics.lake import checkpoint
from kvtrail.forensics.lake.executor import worker_threads
from kvtrail.forensics.lake.task import (
    SHARED_TABLES,
    PartitionResult,
    PartitionTask,
    events_columns,
    producer_ids,
    read_checked,
    read_tables,
    replay_span,
    run_task,
    task_filter,
)
from kvtrail.forensics.replay.engine import ReplayEngine
from kvtrail.forensics.replay.source import EVENTS_PER_SLICE

TASKS_PER_SLOT = 4
MAX_GROUP_HOURS = 24
# A group reads consecutive hours at once while their events number at most this together (one store_batches
# over them: its slices' set-up, the catalog and the reader's fixed costs paid once); the reader still slices
# what it reads, and a worker holds at most this many events' rows besides one slice's page lists.
CHUNK_EVENTS = 2 * EVENTS_PER_SLICE


@dataclass(frozen=True)
class TaskGroup:
    """``pages`` tasks of one node's consecutive hours, replayed in order by one engine."""

    tasks: tuple[PartitionTask, ...]

    def __post_init__(self) -> None:
        assert len(self.tasks) > 1 and all(_joins(a, b) for a, b in zip(self.tasks, self.tasks[1:])), "task group"

    @property
    def cost(self) -> int:
        return sum(t.cost for t in self.tasks)

    def label(self) -> str:
        first, last = self.tasks[0], self.tasks[-1]
        return f"pages {first.cluster}/{first.node} hours {first.hours[0]}..{last.hours[-1]}"


Planned = PartitionTask | TaskGroup


def _joins(a: PartitionTask, b: PartitionTask) -> bool:
    """Whether ``b`` continues ``a``: the same node and question, the next hour, both page replays."""
    return (
        a.mode == b.mode == "pages"
        and (a.url, a.cluster, a.node) == (b.url, b.cluster, b.node)
        and b.hours[0] == a.hours[-1] + 1
        and (a.starts, a.to_ns, a.policy, a.codes) == (b.starts, b.to_ns, b.policy, b.codes)
    )


def group_tasks(tasks: Sequence[PartitionTask], slots: int | None) -> list[Planned]:
    """``tasks`` (a plan, each node's hours in order) with runs of one node's consecutive ``pages`` tasks
    joined (see the module doc); ``slots``: the cluster's, None to leave every task alone."""
    if not slots or slots < 1:
        return list(tasks)
    # one slot runs the tasks one after another: nothing to balance, only the day's bound
    share = sum(t.cost for t in tasks) / (TASKS_PER_SLOT * slots) if slots > 1 else float("inf")
    out: list[Planned] = []
    run: list[PartitionTask] = []

    def flush() -> None:
        if run:
            out.append(run[0] if len(run) == 1 else TaskGroup(tuple(run)))

    for t in tasks:
        if run and _joins(run[-1], t) and len(run) < MAX_GROUP_HOURS and sum(r.cost for r in run) + t.cost <= share:
            run.append(t)
            continue
        flush()
        run = [t]
    flush()
    return out


def chunks(tasks: Sequence[PartitionTask], max_rows: int | None = None) -> list[list[PartitionTask]]:
    """A group's tasks in runs read at once: as many hours as hold at most ``max_rows`` events together
    (:data:`CHUNK_EVENTS`), at least one hour each."""
    limit = CHUNK_EVENTS if max_rows is None else max_rows
    out: list[list[PartitionTask]] = []
    for t in tasks:
        if out and sum(u.rows for u in out[-1]) + t.rows <= limit:
            out[-1].append(t)
        else:
            out.append([t])
    return out


def _span(tasks: list[PartitionTask]) -> PartitionTask:
    """The hours of ``tasks`` as one task: their partition files together, the shared files once."""
    first = tasks[0]

    def joined(name: str, entries: tuple) -> tuple:
        if name in SHARED_TABLES:
            return entries
        return tuple(e for t in tasks for n, es in t.files if n == name for e in es)

    files = tuple((name, joined(name, entries)) for name, entries in first.files)
    return dataclasses.replace(first, hours=tuple(h for t in tasks for h in t.hours), files=files)


def _naming_hours(con, span: PartitionTask, ids: list[str]) -> dict[str, int]:
    """The hour of each id's first event naming a tenant among the span's events (engine order is time)."""
    if len(span.hours) == 1 or not ids:
        return dict.fromkeys(ids, span.hours[0])
    where, params = task_filter(span, span.hours[0] * HOUR_NS, (span.hours[-1] + 1) * HOUR_NS)
    rows = con.execute(
        f"SELECT request_id, min(wall_ns) FROM events_v WHERE {where} AND tenant_id IS NOT NULL "
        "AND request_id IN (SELECT unnest(?)) GROUP BY request_id",
        [*params, ids],
    ).fetchall()
    first = {rid: hour_of(int(wall)) for rid, wall in rows}
    return {rid: first.get(rid, span.hours[0]) for rid in ids}


def run_group(group: TaskGroup) -> PartitionResult:
    """Replay the group's hours in order from its first task's start (in a worker process or in-process)."""
    first = group.tasks[0]
    lake = LakeFS.open(first.url)
    threads = worker_threads()
    out = PartitionResult(first.cluster, first.node, tuple(h for t in group.tasks for h in t.hours))
    engine: ReplayEngine | None = None
    shared: dict = {}  # the files every hour lists alike (producers, batches): read once
    named = 0
    for chunk in chunks(group.tasks):
        span = _span(chunk)
        with memory_catalog(read_tables(lake, span, threads, shared, events_columns(first)), threads) as con:
            if engine is None:
                engine = ReplayEngine(producer_ids(con), first.policy, codes=first.codes)
                if first.checkpoint is not None:
                    checkpoint.restore(read_checked(lake, *first.checkpoint), engine.state)
                named = len(engine.state.tenants)
            for t in chunk:  # not needed, but a question never answers over an altered file
                if t is not first and t.checkpoint is not None:
                    read_checked(lake, *t.checkpoint)
            replay_span(con, span, engine, out, threads, span.hours[0] * HOUR_NS, (span.hours[-1] + 1) * HOUR_NS)
            # ids first named in a later hour than the group's first: the merge orders namings by hour
            fresh = list(islice(engine.state.tenants, named, None))
            out.tenant_hours.update({r: h for r, h in _naming_hours(con, span, fresh).items() if h != out.hours[0]})
        named = len(engine.state.tenants)
    assert engine is not None
    out.found = list(engine.state.found)
    out.joins = engine.state.joins
    out.tenants = dict(engine.state.tenants)
    return out


def run_planned(item: Planned) -> PartitionResult:
    """A planned item: a group of hours or a single task."""
    return run_group(item) if isinstance(item, TaskGroup) else run_task(item)
