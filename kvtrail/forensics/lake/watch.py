"""``kvtrail forensics watch --lake``: follow an audit lake as exports arrive, each new finding printed once.

An export writes its files first and its manifest last, so a new manifest number is the one signal
that the lake grew, and the files it lists are complete. On each new manifest :class:`LakeWatch` plans
the whole history's tasks (every (node, hour) partition from its checkpoint, as ``findings --lake``
without a window), re-runs only the tasks whose files or checkpoint changed (the manifest's SHA-256s
say which: a new hour, an hour that received more events, a checkpoint rewritten by a later export),
keeps the others' results, and resolves the cross-partition joins over all of them. Findings are told
apart by their stable id (:func:`~kvtrail.forensics.results.persist.finding_id`): one already printed is not
printed again. As with ``watch --db``, a cross-node finding (F2/F4/F9) whose other half lands in a
later export shows up then, under its final evidence; nothing printed is taken back.
"""

from __future__ import annotations

from kvtrail.audit.lake.fs import LakeFS
from kvtrail.audit.lake.manifest import manifest_numbers
from kvtrail.forensics.findings import Finding
from kvtrail.forensics.lake.executor import Executor, LocalExecutor, map_largest_first
from kvtrail.forensics.lake.merge import merged_findings
from kvtrail.forensics.lake.plan import plan_tasks
from kvtrail.forensics.lake.questions import open_lake
from kvtrail.forensics.lake.task import PartitionResult, PartitionTask, run_task
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.results.persist import finding_id


def _task_key(t: PartitionTask) -> tuple:
    return (t.cluster, t.node, t.hours)


def _inputs(t: PartitionTask) -> tuple:
    """What a task's answer depends on: its partition's files and checkpoint (the shared producers and
    batches files grow with every export without changing a partition's events)."""
    return (t.mode, t.checkpoint, tuple(e for table, e in t.files if table in ("events", "page_runs")))


class LakeWatch:
    """New findings of a lake, export by export (see the module doc)."""

    def __init__(self, url: str, policy: ForensicsPolicy = ForensicsPolicy(), executor: Executor | None = None):
        self.url, self.policy = url, policy
        self.executor = executor or LocalExecutor()
        self.fs = LakeFS.open(url)
        self.manifest = 0  # the last manifest judged
        self.seen: set[str] = set()
        self.results: dict[tuple, tuple[PartitionTask, PartitionResult]] = {}
        self.tasks_run = 0

    def poll(self) -> list[Finding]:
        """The findings not reported before, once the lake has a manifest newer than the last one judged."""
        numbers = manifest_numbers(self.fs)
        if not numbers or numbers[-1] == self.manifest:
            return []
        with open_lake(self.url, numbers[-1]) as lake:
            tasks = plan_tasks(lake.fs, lake.manifest, lake.con, None, None, self.policy, None, need_joins=True)
            stale = [
                t
                for t in tasks
                if _task_key(t) not in self.results or _inputs(self.results[_task_key(t)][0]) != _inputs(t)
            ]
            fresh = map_largest_first(self.executor, run_task, stale, lambda t: t.cost, label="partitions")
            for t, r in zip(stale, fresh):
                self.results[_task_key(t)] = (t, r)
            self.tasks_run += len(stale)
            keep = {_task_key(t) for t in tasks}
            self.results = {k: v for k, v in self.results.items() if k in keep}
            found = merged_findings([r for _, r in self.results.values()], self.policy, None, None, need_joins=True)
        self.manifest = numbers[-1]
        new = []
        for f in found:
            fid = finding_id(f)
            if fid not in self.seen:
                self.seen.add(fid)
                new.append(f)
        return new
