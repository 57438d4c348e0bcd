"""SIGKILL a process while it records: every flush()-acknowledged batch survives, the store opens without repair."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvtrail.audit.batch import from_dicts
from kvtrail.audit.store import AuditStore
from kvtrail.audit.verify import verify_store
from tests.conftest import alloc, config, producer

CHILD = textwrap.dedent("""
    import sys, numpy as np
    from kvtrail.audit.events import Producer, RequestRef
    from kvtrail.audit.recorder import Recorder, RecorderConfig
    rec = Recorder(sys.argv[1], Producer("c1", "prefill-0", "prefill", "kvtrail-reference", "0.1", "crash"),
                   RecorderConfig(capacity_events=10_000_000, flush_interval_s=0.002))
    rec.node_config(pool_tokens=4096 * 16, pool_pages=4096, page_size=16, context_tokens=65536)
    pages = np.arange(1, 65, dtype=np.int32)
    i = 0
    while True:
        for _ in range(500):
            rec.pages_allocated(RequestRef(f"r{i}", i, "t1"), pages + (i % 4000), "prefill_extend")
            i += 1
        recorded = rec.stats()["recorded_events"]
        assert rec.flush(30)
        print(recorded, flush=True)   # everything with seq < recorded is acknowledged durable
""")


@pytest.mark.slow
@pytest.mark.parametrize("extra_delay_s", [0.0, 0.004, 0.03])
def test_sigkill_keeps_every_acknowledged_batch(tmp_path, extra_delay_s):
    db = tmp_path / "crash.duckdb"
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(db)], stdout=subprocess.PIPE, env=env, text=True)
    acked = 0
    try:
        for _ in range(6):
            line = child.stdout.readline()
            assert line, "recorder process ended early"
            acked = int(line)
        time.sleep(extra_delay_s)  # kill while it keeps recording and committing
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL
    with AuditStore(db) as store:  # opens with no manual repair (DuckDB replays its WAL)
        n, max_seq = store.con.execute("SELECT count(*), max(seq) FROM events").fetchone()
        present = store.con.execute("SELECT count(*) FROM events WHERE seq < ?", [acked]).fetchone()[0]
        assert present == acked >= 3000
        assert max_seq + 1 == n  # nothing half-written: what is there is a gap-free prefix
        assert store.con.execute("SELECT count(*) FROM events WHERE kind = 'recorder_gap'").fetchone()[0] == 0
        # the reopened store keeps accepting data
        restarted = producer(instance="after-crash")
        store.append(from_dicts([config(0, restarted), alloc(1, [1], prod=restarted)]))
    report = verify_store(db)
    assert report.ok, [str(p) for p in report.problems]
