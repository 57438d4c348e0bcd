"""Where the fan-out runs: one small interface, in-process or on Dask distributed.

An :class:`Executor` maps a module-level function over task descriptions and returns every result, in
order, or raises: it never returns part of the answers. :class:`LocalExecutor` runs them one after
another in this process; :class:`DaskExecutor` submits them to a Dask cluster - an existing scheduler
(``--scheduler tcp://HOST:PORT``) or a local one of N worker processes it starts on loopback
(``--workers N``). Dask re-runs the tasks of a worker that dies; a task that keeps failing (or kills
its workers) ends the question with one clear error. Another engine (Ray, Spark) would be one more
class with ``map`` and ``close``.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Protocol, Sequence

from kvtrail.errors import KvtrailError


def worker_threads() -> int | None:
    """The threads a task may use where it runs: a Dask worker's thread count (its share of the machine's
    cores), or None outside a worker (all of them). A one-thread worker stands for one core: a task that
    ran helper threads there (a read-ahead, DuckDB's or Arrow's thread pools) would take cores from the
    other workers and make one worker look faster than one core."""
    dist = sys.modules.get("distributed")  # never imported by a process that is not a Dask worker
    if dist is None:
        return None
    try:
        return int(dist.get_worker().state.nthreads)
    except ValueError:  # not inside a worker's task
        return None


def worker_environ() -> dict:
    """The environment Dask's nannies give the workers kvtrail starts: Dask's own, less
    ``MALLOC_TRIM_THRESHOLD_``. Dask sets it (64 KiB) so that workers hand freed memory back to the
    system; setting it at all also turns off glibc's adaptive thresholds, so every large array a task
    allocates is mapped and faulted in afresh. A task here allocates per partition (pages, runs,
    checkpoint arrays) and is bounded by one partition, so that cost buys nothing: on the fleet benchmark's
    lake, 40 tasks on one worker took 16.4-17.6 s with it and 13.5-14.5 s without."""
    from dask import config as dask_config

    env = dict(dask_config.get("distributed.nanny.pre-spawn-environ", default={}) or {})
    env.pop("MALLOC_TRIM_THRESHOLD_", None)
    return env


class Executor(Protocol):
    """Runs ``fn`` over ``items``; all results in order, or an exception."""

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any], label: str = "tasks") -> list[Any]: ...

    def slots(self) -> int:
        """How many tasks it runs at once (the threads of all its workers): how finely a question's
        partitions are worth cutting (:func:`~kvtrail.forensics.lake.groups.group_tasks`)."""
        ...

    def close(self) -> None: ...


def map_largest_first(
    executor: Executor,
    fn: Callable[[Any], Any],
    items: Sequence[Any],
    cost: Callable[[Any], float],
    label: str = "tasks",
) -> list[Any]:
    """``executor.map(fn, items)``, the items handed out in decreasing ``cost`` (the results in the order of
    ``items``): a cluster starts its longest tasks first and ends on short ones, so its workers finish
    together instead of one waiting on the last large task."""
    order = sorted(range(len(items)), key=lambda k: -cost(items[k]))
    results = executor.map(fn, [items[k] for k in order], label=label)
    if len(results) != len(items):
        raise KvtrailError(f"lake: {len(results)} of {len(items)} {label} answered; no answer")
    out: list[Any] = [None] * len(items)
    for k, r in zip(order, results):
        out[k] = r
    return out


class LocalExecutor:
    """Every task in this process, one after another (the reference, and what tests compare against)."""

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any], label: str = "tasks") -> list[Any]:
        return [fn(item) for item in items]

    def slots(self) -> int:
        return 1

    def close(self) -> None:
        pass


class DaskExecutor:
    """Tasks on a Dask cluster: ``scheduler`` (an address) or ``workers`` local processes on 127.0.0.1.

    ``progress``: a progress bar on stderr (default: when stderr is a terminal). ``retries``: how often
    Dask re-runs a task that raised (a task on a worker that died is re-run regardless, up to the
    scheduler's ``allowed-failures``).
    """

    def __init__(
        self,
        scheduler: str | None = None,
        workers: int | None = None,
        *,
        progress: bool | None = None,
        retries: int = 1,
    ):
        if (scheduler is None) == (workers is None):
            raise ValueError("DaskExecutor: give exactly one of scheduler or workers")
        try:
            from dask import config as dask_config
            from distributed import Client, LocalCluster
        except ImportError:
            raise KvtrailError(
                "--scheduler/--workers: Dask distributed is not installed (pip install 'kvtrail[lake]')"
            ) from None
        self.cluster = None
        try:
            if workers is not None:
                if workers < 1:
                    raise ValueError("workers: must be >= 1")
                with dask_config.set({"distributed.nanny.pre-spawn-environ": worker_environ()}):
                    self.cluster = LocalCluster(
                        n_workers=workers,
                        threads_per_worker=1,
                        processes=True,
                        host="127.0.0.1",
                        dashboard_address="127.0.0.1:0",
                    )
                self.client = Client(self.cluster)
            else:
                self.client = Client(scheduler, timeout=30)
        except OSError as exc:
            raise KvtrailError(f"--scheduler: cannot reach the Dask scheduler {scheduler}: {exc}") from None
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.retries = retries

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any], label: str = "tasks") -> list[Any]:
        from distributed import as_completed

        futures = self.client.map(fn, list(items), pure=False, retries=self.retries)
        try:
            bar = None
            if self.progress:
                from tqdm import tqdm

                bar = tqdm(total=len(futures), desc=label, unit="task", file=sys.stderr)
            for fut in as_completed(futures):
                if fut.status == "error":
                    break
                if bar is not None:
                    bar.update(1)
            if bar is not None:
                bar.close()
            return self.client.gather(futures)
        except KvtrailError:
            raise
        except Exception as exc:  # any worker-side failure ends the question, named, with no answer
            raise KvtrailError(
                f"lake: a partition task failed on the Dask cluster ({type(exc).__name__}: {exc}); "
                "no answer was produced"
            ) from exc
        finally:
            self.client.cancel(futures)

    def slots(self) -> int:
        return max(1, sum(self.client.nthreads().values()))

    def close(self) -> None:
        self.client.close()
        if self.cluster is not None:
            self.cluster.close()
