"""The checkpoint policy bounds what lives only in ``<db>.wal``: by WAL size, by time, and at close."""

from __future__ import annotations

import math
import shutil
import time

import duckdb
import pytest

from kvtrail.audit.batch import from_dicts
from kvtrail.audit.store import AuditStore, CheckpointPolicy
from kvtrail.audit.storefile import wal_path
from kvtrail.audit.verify import verify_store
from tests.conftest import alloc, config

NEVER = CheckpointPolicy(max_wal_bytes=2**30, max_interval_s=math.inf)


def _batch(seq0: int, n: int = 20):
    return from_dicts([alloc(seq0 + i, [1 + (seq0 + i) % 60]) for i in range(n)])


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_wal_bytes": 0}, "max_wal_bytes"),
        ({"max_interval_s": 0.0}, "max_interval_s"),
        ({"max_interval_s": math.nan}, "max_interval_s"),
    ],
)
def test_a_bad_policy_names_its_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CheckpointPolicy(**kwargs)


def test_defaults_bound_the_wal_by_size_and_time():
    assert CheckpointPolicy() == CheckpointPolicy(max_wal_bytes=64 * 2**20, max_interval_s=10.0)


def test_size_bound_checkpoints_after_the_commit_that_crosses_it(tmp_path):
    path = tmp_path / "a.duckdb"
    with AuditStore(path, checkpoint=CheckpointPolicy(max_wal_bytes=1, max_interval_s=math.inf)) as s:
        s.append(from_dicts([config(0)]))
        s.append(_batch(1))
        assert s.checkpoints == 2 and s.wal_bytes() == 0
        assert not wal_path(path).exists() or wal_path(path).stat().st_size == 0


class _Clock:
    """The store module's ``time``, its monotonic clock moved by the test (a loaded machine's real clock could
    pass the interval between two lines of the test)."""

    def __init__(self):
        self.now = time.monotonic()

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    """The store module's clock, moved by the test; the store opened under it bounds its WAL to 1 s."""
    clock = _Clock()
    monkeypatch.setattr("kvtrail.audit.store.time", clock)
    return clock


ONE_SECOND = CheckpointPolicy(max_wal_bytes=2**30, max_interval_s=1.0)


def test_time_bound_checkpoints_the_first_commit_after_the_interval(tmp_path, clock):
    with AuditStore(tmp_path / "a.duckdb", checkpoint=ONE_SECOND) as s:
        s.append(from_dicts([config(0)]))
        assert s.checkpoints == 0 and s.wal_bytes() > 0  # committed, still only in the WAL
        clock.now += 0.9
        assert not s.maybe_checkpoint()
        clock.now += 0.2
        s.append(_batch(1))
        assert s.checkpoints == 1 and s.wal_bytes() == 0 and s.checkpoint_s > 0


def test_the_interval_counts_from_the_first_commit_in_the_wal_not_from_the_last_checkpoint(tmp_path, clock):
    path = tmp_path / "a.duckdb"
    with AuditStore(path, checkpoint=ONE_SECOND) as s:
        s.append(from_dicts([config(0)]))
        clock.now += 1.1
        s.append(_batch(1))
        assert s.checkpoints == 1 and s.wal_bytes() == 0
        clock.now += 60.0  # idle, nothing only in the WAL
        assert not s.maybe_checkpoint()
        s.append(_batch(21))  # the first commit after the idle hour is not checkpointed alone, at once
        assert s.checkpoints == 1 and s.wal_bytes() > 0
        clock.now += 0.9
        s.append(_batch(41))
        assert s.checkpoints == 1
        clock.now += 0.2  # the WAL has held data for 1.1 s: an idle tick checkpoints it
        assert s.maybe_checkpoint()
        assert s.checkpoints == 2 and s.wal_bytes() == 0
    assert verify_store(path).events_checked == 61


def test_a_wal_emptied_outside_the_policy_restarts_its_clock(tmp_path, clock):
    with AuditStore(tmp_path / "a.duckdb", checkpoint=ONE_SECOND) as s:
        s.append(from_dicts([config(0)]))  # the WAL's clock starts
        s.con.execute("CHECKPOINT")  # as DuckDB's own size trigger would: the WAL is empty again
        assert not s.maybe_checkpoint()  # an idle tick sees it empty
        clock.now += 5.0
        s.append(_batch(1))  # a fresh WAL: its clock starts now, not at the first commit
        assert s.checkpoints == 0 and s.wal_bytes() > 0
        clock.now += 1.1
        assert s.maybe_checkpoint() and s.checkpoints == 1


def test_without_bounds_the_main_file_lags_until_close_checkpoints(tmp_path):
    path = tmp_path / "a.duckdb"
    s = AuditStore(path, checkpoint=NEVER)
    s.append(from_dicts([config(0)]))
    s.append(_batch(1))
    assert s.checkpoints == 0 and s.wal_bytes() > 0
    s.close()
    s.close()  # a second close does nothing
    assert not wal_path(path).exists()
    alone = tmp_path / "alone" / "a.duckdb"
    alone.parent.mkdir()
    shutil.copyfile(path, alone)  # after close the main file alone holds everything
    assert verify_store(alone).events_checked == 21


class _FailingCheckpoint:
    """A connection whose CHECKPOINT fails (a full disk), everything else passed through."""

    def __init__(self, con):
        self._con = con

    def execute(self, sql, *args):
        if sql == "CHECKPOINT":
            raise duckdb.IOException("IO Error: No space left on device")
        return self._con.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self._con, name)


def test_a_failed_checkpoint_does_not_fail_the_committed_batch(tmp_path, caplog):
    path = tmp_path / "a.duckdb"
    s = AuditStore(path, checkpoint=CheckpointPolicy(max_wal_bytes=1, max_interval_s=math.inf))
    real = s.con
    s.con = _FailingCheckpoint(real)
    res = s.append(from_dicts([config(0), alloc(1, [1])]))
    assert res.num_events == 2 and s.checkpoints == 0
    assert s.checkpoint_error == "IO Error: No space left on device"
    assert "checkpoint of" in caplog.text and "retried after the next commit" in caplog.text
    s.con = real
    s.append(_batch(2))  # retried, and it works again
    assert s.checkpoints == 1 and s.checkpoint_error is None
    s.close()
    assert verify_store(path).events_checked == 22
