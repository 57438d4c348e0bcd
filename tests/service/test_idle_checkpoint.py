"""The service's writer asks the checkpoint policy when it is idle: the last batches before a quiet spell
reach the main file within the policy's interval, and a store with nothing in its WAL is not checkpointed."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient

from kvtrail.audit.store import CheckpointPolicy
from kvtrail.audit.verify import verify_store
from kvtrail.service import committer as committer_module
from kvtrail.service.app import create_app
from kvtrail.service.state import open_state
from tests.conftest import alloc, config, wait_for
from tests.service.conftest import arrow_body, auth, make_token


def test_a_quiet_service_checkpoints_its_last_commits_and_then_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(committer_module, "IDLE_TICK_S", 0.05)
    db = tmp_path / "svc.duckdb"
    state = open_state(db, checkpoint=CheckpointPolicy(max_wal_bytes=2**30, max_interval_s=0.3))
    try:
        token = make_token(state)
        with TestClient(create_app(state)) as c:
            for body in ([config(0)], [alloc(1 + i, [1 + i]) for i in range(20)]):
                r = c.post("/v1/events", content=arrow_body(body), headers=auth(token))
                assert r.status_code == 200, r.text
        assert state.judge.wait_idle(30)
        # no batch follows: the idle tick checkpoints what the WAL holds once it has held it for the interval
        wait_for("the WAL to be checkpointed", lambda: state.store.wal_bytes() == 0, 10.0, every_s=0.02)
        done = state.store.checkpoints
        assert done >= 1
        time.sleep(0.6)  # twice the interval, a dozen ticks: an empty WAL is not checkpointed again
        assert state.store.checkpoints == done and state.store.wal_bytes() == 0
    finally:
        state.close()
    assert verify_store(db).events_checked == 21
