"""Does the live judge hold what is live, or all it has seen? Its state and RSS over a long synthetic stream.

One process: an ``AuditStore`` (DuckDB capped at ``--memory-limit-mb``) and the service's ``Judge``, fed as
the service feeds it (each committed batch handed over with ``notify``), without HTTP, so the RSS is the
judge's and the store's. ``--producers`` synthetic decode nodes (``kvtrail.sim.synth``; its clock runs far
faster than real time, so the horizon is given in seconds of that history) append batches round robin;
every ``--events`` / 12 events the judge is waited for and a row printed: RSS, DuckDB's own memory, the
request index slots and live requests the replay holds, ids retired, forward writes held, and the model
monitors' requests.

    .venv/bin/python bench/bench_judge_memory.py                    # 900,000 events, horizon 0.3 s of history
    .venv/bin/python bench/bench_judge_memory.py --horizon-s 1e6    # a horizon the history never passes
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from kvtrail.audit.events import Producer
from kvtrail.audit.store import AuditStore
from kvtrail.service.judge import Judge
from kvtrail.sim.synth import synth_batches


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=900_000)
    ap.add_argument("--producers", type=int, default=3)
    ap.add_argument("--horizon-s", type=float, default=0.3, help="the judge's horizon, in seconds of history")
    ap.add_argument("--memory-limit-mb", type=int, default=1024)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = AuditStore(Path(tmp) / "judge.duckdb")
        store.con.execute(f"SET memory_limit = '{args.memory_limit_mb}MB'")
        judge = Judge(store.cursor, horizon_ns=int(args.horizon_s * 1e9))
        gens = [
            synth_batches(
                producer=Producer("bench", f"decode-{i}", "decode", "kvtrail-reference", "0.1", f"mem-{i}"),
                num_pages=65_536,
                page_size=16,
                seed=i,
                target_page_events=args.events * 40,
                events_per_batch=2_000,
            )
            for i in range(args.producers)
        ]
        print("events    RSS MB  DuckDB MB  slots  requests  retired  forward writes  model requests  s")
        fed, step, t0 = 0, args.events // 12, time.monotonic()
        mark = step
        while fed < args.events:
            for g in gens:
                res = store.append(next(g))
                assert res.table is not None
                judge.notify(table=res.table, batches=dict(res.batches))
                fed += res.table.num_rows
            if fed >= mark or fed >= args.events:
                mark += step
                judge.wait_idle(300)
                state, ret = judge.replay.engine.state, judge.replay.retirement
                row = store.con.execute("SELECT sum(memory_usage_bytes) FROM duckdb_memory()").fetchone()
                duck = row[0] if row else 0
                print(
                    f"{fed:>9,}  {_rss_mb():>6.0f}  {duck / 1e6:>9.0f}  {len(state.requests):>5}  "
                    f"{len(state.request_index):>8}  {ret.retired:>7}  {len(state.joins.forward_writes):>14}  "
                    f"{judge.model.stats()['requests']:>14}  {time.monotonic() - t0:.0f}",
                    flush=True,
                )
        judge.close()
        store.close()


if __name__ == "__main__":
    main()
