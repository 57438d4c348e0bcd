"""The fan-out on a real Dask cluster: a scheduler and two worker processes on loopback, started here.

The same question through ``--scheduler`` answers as ``--db`` does; a worker killed mid-query leaves
either the full answer (Dask re-runs its tasks on the other worker) or a clear error, never part of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow as pa
import pytest

from kvtrail import forensics as fx
from kvtrail.audit.lake.catalog import LAKE_TABLES
from kvtrail.cli import main
from kvtrail.errors import KvtrailError
from kvtrail.forensics.lake.executor import DaskExecutor, worker_environ, worker_threads
from kvtrail.forensics.lake.questions import lake_findings, open_lake
from kvtrail.forensics.replay.batch import PRODUCER_NAMES
from kvtrail.forensics.replay.engine import replay_store
from tests.conftest import wait_for

distributed = pytest.importorskip("distributed")
DEADLINE_S = 120


def _wait_for(what: str, check):
    return wait_for(what, check, DEADLINE_S, every_s=0.1)


@contextlib.contextmanager
def _cluster(base: Path):
    """(scheduler address, worker processes): ``dask scheduler --port 0`` and two ``dask worker``s."""
    sched_file = base / "scheduler.json"
    common = ["--no-dashboard"]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distributed.cli.dask_scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--scheduler-file",
                str(sched_file),
                *common,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    ]
    try:
        _wait_for("the scheduler file", lambda: sched_file.exists() and sched_file.stat().st_size > 0)
        addr = json.loads(sched_file.read_text())["address"]
        workers = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "distributed.cli.dask_worker",
                    "--scheduler-file",
                    str(sched_file),
                    "--nthreads",
                    "1",
                    "--no-nanny",
                    "--host",
                    "127.0.0.1",
                    *common,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for _ in range(2)
        ]
        procs += workers
        with distributed.Client(addr, timeout=60) as client:
            client.wait_for_workers(2, timeout=DEADLINE_S)
        yield addr, workers
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def dask_cluster(tmp_path_factory):
    """A cluster the module's tests share."""
    with _cluster(tmp_path_factory.mktemp("dask")) as cluster:
        yield cluster


@pytest.fixture
def cluster_to_kill(tmp_path_factory):
    """A cluster of the test's own: it leaves one worker short, whichever tests run after it and where."""
    with _cluster(tmp_path_factory.mktemp("dask-kill")) as cluster:
        yield cluster


def test_same_answer_through_scheduler(dask_cluster, fleet_lake, fleet_db, capsys):
    addr, _ = dask_cluster
    assert main(["forensics", "findings", "--db", fleet_db, "--format", "json"]) == 0
    want = capsys.readouterr().out
    assert main(["forensics", "findings", "--lake", fleet_lake, "--scheduler", addr, "--format", "json"]) == 0
    assert capsys.readouterr().out == want


def test_local_workers(fleet_lake, fleet_db, capsys):
    assert main(["forensics", "affected", "--db", fleet_db, "--format", "csv"]) == 0
    want = capsys.readouterr().out
    assert main(["forensics", "affected", "--lake", fleet_lake, "--workers", "2", "--format", "csv"]) == 0
    assert capsys.readouterr().out == want


def test_report_through_scheduler(dask_cluster, fleet_lake, fleet_db, tmp_path):
    addr, _ = dask_cluster
    span = ["--from", "2026-09-01T00:59:50Z", "--to", "2026-09-01T01:00:10Z"]
    assert main(["forensics", "report", "--db", fleet_db, *span, "--out", str(tmp_path / "db")]) == 0
    assert (
        main(["forensics", "report", "--lake", fleet_lake, "--scheduler", addr, *span, "--out", str(tmp_path / "lake")])
        == 0
    )
    digest = [json.loads((tmp_path / d / "report.json").read_text())["results_digest"] for d in ("db", "lake")]
    assert digest[0] == digest[1]
    assert main(["forensics", "verify-report", str(tmp_path / "lake"), "--lake", fleet_lake, "--scheduler", addr]) == 0


def test_a_task_uses_its_worker_threads_only(dask_cluster):
    """A one-thread worker stands for one core: a task there runs no helper threads of its own."""
    addr, _ = dask_cluster
    assert worker_threads() is None  # outside a worker: the machine's cores
    executor = DaskExecutor(addr, progress=False)
    try:
        assert executor.map(_threads_here, [0, 1]) == [(1, "1"), (1, "1")]
    finally:
        executor.close()


def test_local_workers_run_without_a_malloc_trim_threshold():
    assert "MALLOC_TRIM_THRESHOLD_" not in worker_environ() and worker_environ().get("OMP_NUM_THREADS") in (1, "1")
    executor = DaskExecutor(workers=1, progress=False)
    try:
        got = executor.client.run(lambda: (os.environ.get("MALLOC_TRIM_THRESHOLD_"), os.environ.get("OMP_NUM_THREADS")))
        assert list(got.values()) == [(None, "1")]
        assert os.environ.get("MALLOC_TRIM_THRESHOLD_") is None  # nor set in this process for later children
    finally:
        executor.close()


def _threads_here(_: int) -> tuple[int | None, str]:
    from kvtrail.audit.lake.catalog import open_memory_catalog

    tables = {t: pa.table({"producer_id": pa.array([], pa.int64())}) for t in LAKE_TABLES}
    tables["producers"] = pa.table(
        {"producer_id": pa.array([], pa.int64()), **{c: pa.array([], pa.string()) for c in PRODUCER_NAMES}}
    )
    con = open_memory_catalog(tables, worker_threads())
    try:
        return worker_threads(), str(con.execute("SELECT current_setting('threads')").fetchall()[0][0])
    finally:
        con.close()


def test_worker_killed_mid_query_gives_all_or_a_clear_error(cluster_to_kill, fleet_lake, fleet_con):
    addr, workers = cluster_to_kill
    want = replay_store(fleet_con)
    outcome: dict = {}

    def ask() -> None:
        executor = DaskExecutor(addr, progress=False)
        try:
            with open_lake(fleet_lake) as lake:
                outcome["found"] = lake_findings(lake, fx.Window(), executor=executor)
        except KvtrailError as exc:
            outcome["error"] = str(exc)
        finally:
            executor.close()

    with distributed.Client(addr, timeout=60) as client:
        pids = {pid: a for a, pid in client.run(os.getpid).items()}
        th = threading.Thread(target=ask)
        th.start()
        busy = _wait_for("a worker running a task", lambda: [a for a, keys in client.processing().items() if keys])
        victim = next(p for p in workers if pids.get(p.pid) == busy[0])
        victim.kill()
        victim.wait(timeout=30)
        th.join(DEADLINE_S)
    assert not th.is_alive()
    if "found" in outcome:
        assert outcome["found"] == want
    else:
        assert "no answer" in outcome["error"], outcome
