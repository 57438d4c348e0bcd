"""The SQL engine on a lake: per-(node, hour) tasks from the partition's checkpoint, then the cross-node codes.

A task (the plan's :class:`~kvtrail.forensics.lake.task.PartitionTask`) reads its partition's files
(checked against the manifest), turns the checkpoint at its hour's start into a prelude of synthetic
events (:mod:`kvtrail.forensics.lake.prelude`) and runs :func:`~kvtrail.forensics.sql.engine.sql_findings`
on the prelude followed by the hour's events: the page findings F1, F5, F6, F7 and F10. Its page joins
then only ever see one hour of one node, so their cost is bounded by the rewrites of a page inside an
hour instead of a window. ``chain`` tasks run the engine on their hours from an empty pool, as the
replay does. Synthetic events stand for the real ones the checkpoint keeps: they are replaced by those
in the evidence, and findings on synthetic events themselves (before the hour) are dropped.

The second stage is the engine's own join queries (F2, F3, F4, F8, F9, F11) over the lake's catalog:
they read the join kinds (reservations, sends, receipts, aborts, responses, configs, forward writes)
and no page runs, whatever the window.
"""

from __future__ import annotations

import dataclasses

import pyarrow as pa

from kvtrail.audit.lake.catalog import open_memory_catalog
from kvtrail.audit.lake.fs import LakeFS
from kvtrail.audit.lake.partition import HOUR_NS
from kvtrail.forensics.findings import Finding
from kvtrail.forensics.lake import checkpoint
from kvtrail.forensics.lake.executor import Executor, LocalExecutor, map_largest_first, worker_threads
from kvtrail.forensics.lake.plan import plan_tasks
from kvtrail.forensics.lake.prelude import Prelude, build_prelude
from kvtrail.forensics.lake.task import PartitionResult, PartitionTask, read_checked, read_tables, task_filter
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.replay.joins import CrossNodeJoins
from kvtrail.forensics.replay.state import ReplayState
from kvtrail.forensics.sql.engine import EVENT_ORDER, SqlScope, sql_findings

PAGE_CODES = ("F1", "F5", "F6", "F7", "F10")
CROSS_CODES = ("F2", "F3", "F4", "F8", "F9", "F11")
# Synthetic events first (in their prelude order), then the partition's own in the engine's order.
_ORDER = f"pre ASC NULLS LAST, {EVENT_ORDER}"


def _synthetic_pid(producers: pa.Table) -> int:
    taken = set(producers.column("producer_id").to_pylist())
    pid = -1
    while pid in taken:
        pid -= 1
    return pid


def _producer_row(producers: pa.Table, task: PartitionTask, pid: int, instance: str | None) -> pa.Table:
    """The synthetic producer: a copy of the node's own with the checkpoint's instance."""
    rows = [r for r in producers.to_pylist() if (r["cluster"], r["node"]) == (task.cluster, task.node)]
    assert rows, f"no producer of {task.label()} in its files"
    same = [r for r in rows if r["instance"] == instance] or rows
    row = {**same[0], "producer_id": pid, "instance": instance if instance is not None else same[0]["instance"]}
    return pa.Table.from_pylist([row], schema=producers.schema)


def _with_prelude(tables: dict[str, pa.Table], prelude: Prelude | None, producer: pa.Table | None) -> dict:
    events = tables["events"]
    events = events.append_column("pre", pa.nulls(events.num_rows, pa.int64()))
    if prelude is None:
        return {**tables, "events": events}
    syn_events, syn_runs = prelude.tables(events.schema, tables["page_runs"].schema)
    return {
        **tables,
        "events": pa.concat_tables([syn_events, events]),
        "page_runs": pa.concat_tables([syn_runs, tables["page_runs"]]),
        "producers": pa.concat_tables([tables["producers"], producer]),
    }


def _real(f: Finding, prelude: Prelude) -> Finding:
    """``f`` with each synthetic event of its evidence replaced by the real event it stands for."""
    pid = prelude.producer_id
    if not any(k[0] == pid for k in f.evidence):
        return f
    keys = {prelude.keys[s] if p == pid else (p, s) for p, s in f.evidence if p != pid or s in prelude.keys}
    return dataclasses.replace(f, evidence=tuple(sorted(keys)))


def run_sql_task(task: PartitionTask) -> PartitionResult:
    """Run one task with the SQL engine (in a worker process or in-process)."""
    lake = LakeFS.open(task.url)
    threads = worker_threads()
    tables = read_tables(lake, task, threads)
    lo, hi = min(task.hours) * HOUR_NS, (max(task.hours) + 1) * HOUR_NS
    prelude = producer = None
    if task.checkpoint is not None:
        state = ReplayState(CrossNodeJoins(task.policy))
        info = checkpoint.restore(read_checked(lake, *task.checkpoint), state)
        pool = state.pools.get((task.cluster, task.node))
        if pool is not None:
            pid = _synthetic_pid(tables["producers"])
            prelude = build_prelude(pool, state.requests, state.request_tenants, pid, lo - 1)
            producer = _producer_row(tables["producers"], task, pid, info.instance)
    con = open_memory_catalog(_with_prelude(tables, prelude, producer), threads)
    try:
        where, params = task_filter(task, lo, hi)
        scope = SqlScope(f"(pre IS NOT NULL OR ({where}))", tuple(params), _ORDER)
        found = sql_findings(con, policy=task.policy, codes=task.codes or PAGE_CODES, scope=scope)
        out = PartitionResult(task.cluster, task.node, task.hours)
        out.events = tables["events"].num_rows
        out.found = [f if prelude is None else _real(f, prelude) for f in found if f.last_ns >= lo]
        return out
    finally:
        con.close()


def sql_lake_findings(
    lake,
    from_ns: int | None,
    to_ns: int | None,
    policy: ForensicsPolicy,
    codes: tuple[str, ...] | None,
    executor: Executor | None = None,
) -> list[Finding]:
    """Every finding of the window by the SQL engine on ``lake`` (a :class:`~kvtrail.forensics.lake.questions.Lake`),
    as :func:`~kvtrail.forensics.sql.engine.sql_findings` finds them on the store the lake came from."""
    wanted = None if codes is None else frozenset(codes)
    page = tuple(c for c in PAGE_CODES if wanted is None or c in wanted)
    cross = tuple(c for c in CROSS_CODES if wanted is None or c in wanted)
    found: list[Finding] = []
    if page:
        tasks = plan_tasks(lake.fs, lake.manifest, lake.con, from_ns, to_ns, policy, page, need_joins=False)
        results = map_largest_first(
            executor or LocalExecutor(), run_sql_task, tasks, lambda t: t.cost, label="partitions (sql)"
        )
        found += [f for r in results for f in r.found]
    if cross:
        found += sql_findings(lake.con, from_ns, to_ns, policy, codes=cross)
    found = [f for f in found if from_ns is None or f.last_ns >= from_ns]
    return sorted(found, key=lambda f: (f.last_ns, f.first_ns, int(f.code[1:]), f.evidence))
