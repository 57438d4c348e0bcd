"""Which tasks answer a window on a lake, so that together they replay exactly what one store's replay would.

One store's replay reads each producer from its last ``node_config`` at or before the window's start
(:func:`kvtrail.forensics.window.window_filter`): its pool starts empty there and its cross-node events
count from there. Per node, the plan therefore has:

- ``pages`` tasks for every hour with events from the window's start hour to its end, each starting
  from the checkpoint at its hour's start; the hour in which the replay itself starts begins empty;
- ``joins`` tasks for the hours between that ``node_config`` and the window's start hour: no page
  replay, only what F2/F3/F4/F9 read (reservations, sends, receipts, aborts, responses, forward writes,
  prefix-hit counts);
- one ``chain`` task instead, replaying the node's hours in order from an empty state, where a
  checkpoint cannot stand for the replay's state: the config the replay starts from did not start a
  new pool in the full history (the same instance configured again), another producer of the node has
  events in the window, or the node has no config before the window.

A checkpoint is the state of the full history at its boundary, so without a window start every
node's hours are ``pages`` tasks.
"""

from __future__ import annotations

from collections import defaultdict

import duckdb

from kvtrail.audit.lake.fs import LakeFS
from kvtrail.audit.lake.manifest import LakeManifest
from kvtrail.audit.lake.partition import HOUR_NS, hour_of
from kvtrail.forensics.lake.task import SHARED_TABLES, LakeCoverageError, PartitionTask
from kvtrail.forensics.policy import ForensicsPolicy

NodeKey = tuple[str, str]


def _configs(con: duckdb.DuckDBPyConnection) -> dict[NodeKey, list[tuple[int, int, str]]]:
    """Per node, its node_config events in engine order: (wall_ns, producer_id, instance)."""
    rows = con.execute(
        "SELECT cluster, node, wall_ns, producer_id, instance FROM events_v WHERE kind = 'node_config' "
        "ORDER BY wall_ns, cluster, node, instance, producer_id, seq"
    ).fetchall()
    out: dict[NodeKey, list[tuple[int, int, str]]] = defaultdict(list)
    for c, n, wall, pid, inst in rows:
        out[(c, n)].append((wall, pid, inst))
    return out


def plan_tasks(
    lake: LakeFS,
    m: LakeManifest,
    con: duckdb.DuckDBPyConnection,
    from_ns: int | None,
    to_ns: int | None,
    policy: ForensicsPolicy,
    codes: tuple[str, ...] | None,
    *,
    need_joins: bool,
) -> list[PartitionTask]:
    """The tasks for the window [from_ns, to_ns] (see the module doc)."""
    files = m.files
    shared = tuple((t, tuple((p, f.sha256) for p, f in sorted(files.items()) if f.table == t)) for t in SHARED_TABLES)
    by_part: dict[tuple[NodeKey, int], dict[str, list[tuple[str, str]]]] = defaultdict(lambda: defaultdict(list))
    producers_in: dict[tuple[NodeKey, int], set[int]] = defaultdict(set)
    checkpoints: dict[tuple[NodeKey, int], tuple[str, str]] = {}
    for path, f in sorted(files.items()):
        if f.table in ("events", "page_runs"):
            by_part[f.part][f.table].append((path, f.sha256))
            producers_in[f.part].add(int(f.producer_id or 0))
        elif f.table == "checkpoint":
            checkpoints[f.part] = (path, f.sha256)
    configs = _configs(con)
    to_hour = hour_of(to_ns) if to_ns is not None else None
    tasks: list[PartitionTask] = []

    def task(mode: str, node: NodeKey, hours: list[int], ckpt, starts) -> PartitionTask:
        parts = [by_part[(node, h)] for h in hours]
        tables = tuple((t, tuple(e for p in parts for e in p.get(t, ()))) for t in ("events", "page_runs"))
        cost = sum(files[path].bytes for _, entries in tables for path, _ in entries)
        cost += files[ckpt[0]].bytes if ckpt is not None else 0
        rows = sum(files[path].rows for table, entries in tables if table == "events" for path, _ in entries)
        return PartitionTask(
            lake.url,
            mode,
            node[0],
            node[1],
            tuple(hours),
            tables + shared,
            ckpt,
            tuple(sorted(starts.items())),
            to_ns,
            policy,
            codes,
            cost,
            rows,
        )

    for node in sorted({k for k, _ in by_part}):
        hours = sorted(h for k, h in by_part if k == node and (to_hour is None or h <= to_hour))
        if from_ns is None:
            for h in hours:
                if (node, h) not in checkpoints:
                    raise LakeCoverageError(
                        f"lake {lake.url}: no checkpoint for {node[0]}/{node[1]} hour {h}; "
                        "re-export the lake (kvtrail lake export) or verify it"
                    )
                tasks.append(task("pages", node, [h], checkpoints[(node, h)], {}))
            continue
        cfgs = configs.get(node, [])
        before = [c for c in cfgs if c[0] <= from_ns]
        pids = {p for (k, _), ps in producers_in.items() if k == node for p in ps}
        starts: dict[int, int | None] = {}
        for pid in pids:
            own = [c[0] for c in before if c[1] == pid]
            starts[pid] = own[-1] if own else from_ns
        begin = min((s for s in starts.values() if s is not None), default=from_ns)
        hours = [h for h in hours if h >= hour_of(begin)]
        if not hours:
            continue
        start_cfg = before[-1] if before else None
        k = cfgs.index(start_cfg) if start_cfg is not None else -1
        new_pool = start_cfg is not None and (k == 0 or cfgs[k - 1][2] != start_cfg[2])
        others = {
            p for h in hours if h >= hour_of(start_cfg[0] if start_cfg else begin) for p in producers_in[(node, h)]
        } - ({start_cfg[1]} if start_cfg else set())
        if start_cfg is None or not new_pool or others:
            tasks.append(task("chain", node, hours, None, starts))
            continue
        from_hour = hour_of(from_ns)
        for h in hours:
            if h < from_hour:
                if need_joins:
                    tasks.append(task("joins", node, [h], None, starts))
            elif start_cfg[0] >= h * HOUR_NS:
                tasks.append(task("pages", node, [h], None, starts))
            elif (node, h) in checkpoints:
                tasks.append(task("pages", node, [h], checkpoints[(node, h)], starts))
            else:
                raise LakeCoverageError(
                    f"lake {lake.url}: no checkpoint for {node[0]}/{node[1]} hour {h}; "
                    "re-export the lake (kvtrail lake export) or verify it"
                )
    return tasks
