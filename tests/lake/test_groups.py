"""A node's consecutive hours replayed as one task (groups.py): the same answers as hour by hour and as the
store, each node's hours joined only where the cluster's slots leave room, the shared files read once."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from kvtrail import forensics as fx
from kvtrail.forensics.lake import checkpoint, groups, task
from kvtrail.forensics.lake.executor import LocalExecutor
from kvtrail.forensics.lake.groups import TaskGroup, group_tasks, run_group
from kvtrail.forensics.lake.merge import first_tenants
from kvtrail.forensics.lake.plan import plan_tasks
from kvtrail.forensics.lake.questions import lake_findings, open_lake
from kvtrail.forensics.lake.task import PartitionResult, PartitionTask
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.replay.engine import replay_store
from kvtrail.forensics.results.persist import finding_id
from tests.lake.test_questions import WINDOWS


class Slots(LocalExecutor):
    """In-process, but planned for as if it ran ``n`` tasks at once."""

    def __init__(self, n: int) -> None:
        self.n = n

    def slots(self) -> int:
        return self.n


@pytest.fixture(scope="module")
def lake(fleet_lake):
    with open_lake(fleet_lake) as lk:
        yield lk


def _plan(lake, window=(None, None)) -> list[PartitionTask]:
    return plan_tasks(lake.fs, lake.manifest, lake.con, window[0], window[1], ForensicsPolicy(), None, need_joins=True)


@pytest.mark.parametrize("slots,chunk", [(1, None), (1, 1), (10_000, None)])
@pytest.mark.parametrize("window", WINDOWS)
def test_grouped_and_hour_by_hour_equal_the_store(lake, fleet_con, window, slots, chunk, monkeypatch):
    # one slot: a node's hours one task, read at once (chunk None) or an hour at a time (chunk 1)
    if chunk is not None:
        monkeypatch.setattr(groups, "CHUNK_EVENTS", chunk)
    want = replay_store(fleet_con, *window)
    got = lake_findings(lake, fx.Window(*window), executor=Slots(slots))
    assert got == want
    assert [finding_id(f) for f in got] == [finding_id(f) for f in want]


def test_one_slot_joins_each_nodes_hours(lake):
    tasks = _plan(lake)
    assert all(t.mode == "pages" for t in tasks) and len({t.hours for t in tasks}) == 2
    planned = group_tasks(tasks, 1)
    nodes = {(t.cluster, t.node) for t in tasks}
    assert len(planned) == len(nodes) < len(tasks)  # every node's two hours are one task
    for item in planned:
        assert isinstance(item, TaskGroup)
        hours = [t.hours[0] for t in item.tasks]
        assert hours == list(range(hours[0], hours[0] + len(hours)))
        assert len({(t.cluster, t.node) for t in item.tasks}) == 1
        assert item.cost == sum(t.cost for t in item.tasks)
    assert sorted((t.cluster, t.node, t.hours) for g in planned for t in g.tasks) == sorted(
        (t.cluster, t.node, t.hours) for t in tasks
    )


def test_slots_and_the_days_bound_limit_the_groups(lake, monkeypatch):
    tasks = _plan(lake)
    assert group_tasks(tasks, None) == tasks
    assert group_tasks(tasks, 10_000) == tasks  # a share of the bytes smaller than any hour: nothing joined
    share = sum(t.cost for t in tasks) / (groups.TASKS_PER_SLOT * 2)
    for item in group_tasks(tasks, 2):
        assert not isinstance(item, TaskGroup) or item.cost <= share
    monkeypatch.setattr(groups, "MAX_GROUP_HOURS", 1)
    assert group_tasks(tasks, 1) == tasks


def test_only_page_replays_of_one_question_are_joined(lake):
    window = WINDOWS[3]  # the replay starts in the first hour: joins-only tasks there
    tasks = _plan(lake, window)
    assert {"joins", "pages"} <= {t.mode for t in tasks}
    planned = group_tasks(tasks, 1)
    assert [t for t in planned if not isinstance(t, TaskGroup) and t.mode != "pages"] == [
        t for t in tasks if t.mode != "pages"
    ]
    pages = _plan(lake, WINDOWS[2])  # across the boundary: two page hours per node
    a, b = next((a, b) for a, b in zip(pages, pages[1:]) if groups._joins(a, b))
    assert not groups._joins(a, dataclasses.replace(b, to_ns=(b.to_ns or 0) + 1))  # another question's task
    assert not groups._joins(a, dataclasses.replace(b, node=b.node + "-other"))


def test_a_group_reads_the_shared_files_once_and_its_checkpoint_first(lake, monkeypatch):
    group = next(g for g in group_tasks(_plan(lake), 1) if isinstance(g, TaskGroup))
    read: list[str] = []
    real = task.read_checked

    def counting(lk, path, sha):
        read.append(path)
        return real(lk, path, sha)

    monkeypatch.setattr(task, "read_checked", counting)
    restored: list[str] = []
    real_restore = checkpoint.restore

    def restoring(data, state):
        restored.append(hashlib.sha256(data).hexdigest())
        return real_restore(data, state)

    monkeypatch.setattr(checkpoint, "restore", restoring)
    monkeypatch.setattr(groups, "read_checked", counting)
    out = run_group(group)
    shared = [p for t in group.tasks for name, entries in t.files if name in task.SHARED_TABLES for p, _ in entries]
    assert shared and all(read.count(p) == 1 for p in shared)
    own = [p for t in group.tasks for name, entries in t.files if name not in task.SHARED_TABLES for p, _ in entries]
    assert all(read.count(p) == 1 for p in own)
    # every hour's checkpoint is checked against the manifest, only the first one restored
    assert all(read.count(t.checkpoint[0]) == 1 for t in group.tasks if t.checkpoint is not None)
    assert restored == [group.tasks[0].checkpoint[1]]
    assert out.hours == tuple(h for t in group.tasks for h in t.hours) and out.events > 0


def test_first_tenants_count_a_groups_later_namings_at_their_hour():
    # hour by hour: node b names r0 in hour 0; in hour 1 node a names r1 before node b does (a < b)
    group = PartitionResult("c", "b", (0, 1), tenants={"r0": "t-b0", "r1": "t-b"}, tenant_hours={"r1": 1})
    alone = PartitionResult("c", "a", (1,), tenants={"r1": "t-a"})
    assert first_tenants(sorted([group, alone], key=lambda r: (r.hours[0], r.cluster, r.node))) == {
        "r0": "t-b0",
        "r1": "t-a",
    }
    group.tenant_hours.clear()  # counted at the group's first hour, node b's naming would win
    assert first_tenants([group, alone])["r1"] == "t-b"


def test_chunks_hold_at_most_the_bound_of_events(lake):
    tasks = [t for t in _plan(lake) if t.mode == "pages"]
    assert all(t.rows > 0 for t in tasks)
    assert [len(c) for c in groups.chunks(tasks, 0)] == [1] * len(tasks)  # an hour over the bound is read alone
    bound = max(t.rows for t in tasks) * 2
    cut = groups.chunks(tasks, bound)
    assert [t for c in cut for t in c] == tasks
    assert all(len(c) == 1 or sum(t.rows for t in c) <= bound for c in cut)
    assert all(len(c) > 1 or k == len(cut) - 1 or c[0].rows + cut[k + 1][0].rows > bound for k, c in enumerate(cut))


def test_a_chunks_later_namings_keep_their_hour(lake, monkeypatch):
    """An id a chunk of two hours first names in its second hour counts at that hour, as hour by hour."""
    group = next(g for g in group_tasks(_plan(lake, WINDOWS[2]), 1) if isinstance(g, TaskGroup))
    whole = run_group(group)
    monkeypatch.setattr(groups, "CHUNK_EVENTS", 0)
    hourly = run_group(group)
    assert whole.tenants == hourly.tenants and whole.found == hourly.found
    assert whole.tenant_hours == hourly.tenant_hours
    assert set(whole.tenant_hours.values()) == {group.tasks[-1].hours[0]}
