"""Judging a store whose only event is a 2^25-page node_config, and one whose events use a handful of pages
with ids near 2^30: peak RSS (goal < 100 MB above a 64-page control).

    .venv/bin/python bench/bench_sparse_pool.py [--pool-pages 33554432] [--db bench/out/sparse.duckdb]

The probe of issue 31 sent one such event (336 bytes) and every replay then allocated ~100 B per declared
page (3.4 GB). Page state now follows the highest page id events use, so judging this store costs what
judging a 64-page pool costs. Each judge (``kvtrail forensics findings`` with each engine, and ``--save``
as the service's judge keeps findings) runs in its own process, once on the store and once on a control
store of 64 pages: its peak RSS (VmHWM), its RSS after importing kvtrail's CLI (~225 MB of numpy,
pyarrow, DuckDB, pandas, numba: the same for any store), and the difference, the judging's own cost.
The goal bounds what the declared pool adds: the judge's peak on the store above its peak on the control
(the fixed cost of a judge, numba's kernels and DuckDB's buffers, is ~55-110 MB for any store).

The second store (``--db`` with ``.high`` in its name) is a plausible 2^31-page pool whose events allocate,
write, free and read 4 pages with ids from 2^30 - 1 to 2^31 - 2: page state sized by the highest page id
would be ~100 GB; a page beyond twice the pages used gets an entry of its own instead.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's kvtrail

GOAL_MB = 100.0
PAGE_SIZE = 16


def build(db: Path, pool_pages: int) -> None:
    from kvtrail.audit.batch import from_dicts
    from kvtrail.audit.store import AuditStore

    if db.exists():
        db.unlink()
    db.parent.mkdir(parents=True, exist_ok=True)
    producer = {
        "cluster": "c1",
        "node": "decode-0",
        "role": "decode",
        "engine": "kvtrail-reference",
        "engine_version": "0.1",
        "instance": "i1",
    }
    event = {
        "schema_version": 1,
        "producer": producer,
        "kind": "node_config",
        "seq": 0,
        "wall_ns": 1_788_960_120 * 10**9,
        "mono_ns": 1,
        "pool_tokens": pool_pages * PAGE_SIZE,
        "pool_pages": pool_pages,
        "page_size": PAGE_SIZE,
        "context_tokens": 131_072,
    }
    with AuditStore(db) as store:
        store.append(from_dicts([event]))


# (the top one below 2^31 - 1: the SQL engine overflows INT32 on a run ending at 2^31, a separate bug)
HIGH_PAGES = [2**30 - 1, 2**30 + 5, 2**30 + 6, 2**31 - 2]


def build_high(db: Path) -> None:
    """A 2^31-page pool (page size 1) whose events use the 4 pages of HIGH_PAGES."""
    from kvtrail.audit.batch import from_dicts
    from kvtrail.audit.store import AuditStore

    if db.exists():
        db.unlink()
    producer = {
        "cluster": "c1",
        "node": "decode-0",
        "role": "decode",
        "engine": "kvtrail-reference",
        "engine_version": "0.1",
        "instance": "i1",
    }
    t0 = 1_788_960_120 * 10**9
    r1, r2 = {"request_id": "r1", "tenant_id": "t1"}, {"request_id": "r2", "tenant_id": "t2"}
    rows: list[dict[str, object]] = [
        {"kind": "node_config", "pool_tokens": 2**31, "pool_pages": 2**31, "page_size": 1, "context_tokens": 131_072},
        {"kind": "pages_allocated", "request": r1, "pages": HIGH_PAGES[:3], "purpose": "decode_reservation"},
        {
            "kind": "kv_written",
            "request": r1,
            "pages": HIGH_PAGES[:3],
            "token_start": 0,
            "token_end": 3,
            "source": "transfer_in",
        },
        {"kind": "pages_freed", "request": r1, "pages": HIGH_PAGES[:3], "free_reason": "finish"},
        {"kind": "pages_allocated", "request": r2, "pages": HIGH_PAGES[1:], "purpose": "decode_reservation"},
        {"kind": "kv_read", "request": r2, "pages": HIGH_PAGES[1:]},
    ]
    events = [
        {"schema_version": 1, "producer": producer, "seq": k, "wall_ns": t0 + k, "mono_ns": 1 + k, **row}
        for k, row in enumerate(rows)
    ]
    with AuditStore(db) as store:
        store.append(from_dicts(events))


# Runs in the judge's own process: kvtrail's CLI imported (its floor), then one command; prints the process's
# RSS after the imports and its peak (VmHWM) over the whole run, in kB.
_CHILD = """
import contextlib, io, sys
def kb(field):
    for line in open('/proc/self/status'):
        if line.startswith(field + ':'):
            return int(line.split()[1])
from kvtrail.cli import main
floor = kb('VmRSS')
with contextlib.redirect_stdout(io.StringIO()):
    rc = main(sys.argv[1:])
print(rc, floor, kb('VmHWM'))
"""


def judge(argv: list[str]) -> tuple[int, float, float]:
    """Run ``kvtrail argv`` in its own process, on the kvtrail this script imports: (exit code, RSS after
    importing the CLI in MB, peak RSS in MB)."""
    import kvtrail

    root = os.path.dirname(os.path.dirname(os.path.abspath(kvtrail.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", _CHILD, *argv], capture_output=True, text=True, env=env)
    if out.returncode:
        print(out.stderr, file=sys.stderr)
        return out.returncode, 0.0, 0.0
    rc, floor, peak = out.stdout.split()
    return int(rc), int(floor) / 1024, int(peak) / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool-pages", type=int, default=2**25)
    ap.add_argument("--db", type=Path, default=Path("bench/out/sparse.duckdb"))
    args = ap.parse_args()
    control = args.db.with_name(args.db.stem + ".control.duckdb")
    high = args.db.with_name(args.db.stem + ".high.duckdb")
    build(args.db, args.pool_pages)
    build(control, 64)
    build_high(high)
    commands = {
        "findings --engine replay": ["forensics", "findings", "--engine", "replay", "--format", "json"],
        "findings --engine sql": ["forensics", "findings", "--engine", "sql", "--format", "json"],
        "findings --save": ["forensics", "findings", "--save", "--format", "json"],
    }
    print(
        f"store: one node_config of {args.pool_pages:,} pages ({args.pool_pages * PAGE_SIZE:,} tokens); "
        "control: the same of 64 pages"
    )
    print(f"  {'judge':<26} {'exit':>4} {'peak RSS':>9} {'after imports':>14} {'judging':>8} {'control':>8}")
    worst = worst_control = pool_cost = 0.0
    failed = False
    for name, argv in commands.items():
        rc, floor, peak = judge([*argv, "--db", str(args.db)])
        crc, cfloor, cpeak = judge([*argv, "--db", str(control)])
        failed |= rc != 0 or crc != 0
        worst = max(worst, peak - floor)
        worst_control = max(worst_control, cpeak - cfloor)
        pool_cost = max(pool_cost, peak - cpeak)
        print(f"  {name:<26} {rc:>4} {peak:7.1f}MB {floor:12.1f}MB {peak - floor:6.1f}MB {cpeak - cfloor:6.1f}MB")
    print(f"store: 4 pages used with ids {HIGH_PAGES[0]:,} .. {HIGH_PAGES[-1]:,} of a 2^31-page pool")
    high_cost = 0.0
    for name, argv in commands.items():
        rc, floor, peak = judge([*argv, "--db", str(high)])
        crc, cfloor, cpeak = judge([*argv, "--db", str(control)])
        failed |= rc != 0 or crc != 0
        high_cost = max(high_cost, peak - cpeak)
        print(f"  {name:<26} {rc:>4} {peak:7.1f}MB {floor:12.1f}MB {peak - floor:6.1f}MB {cpeak - cfloor:6.1f}MB")
    verdict = "ok" if max(pool_cost, high_cost) < GOAL_MB and not failed else "MISSED"
    print(
        f"worst judging cost (peak RSS above the process's RSS after importing kvtrail): {worst:.1f} MB "
        f"({worst_control:.1f} MB on the control)"
    )
    print(
        f"what the {args.pool_pages:,}-page pool adds to a judge's peak RSS over the 64-page control: "
        f"{pool_cost:+.1f} MB (goal < {GOAL_MB:.0f} MB; before page state followed use: ~100 B a page)"
    )
    print(
        f"what 4 pages near 2^30 add to a judge's peak RSS over the control: {high_cost:+.1f} MB "
        f"(goal < {GOAL_MB:.0f} MB; sized by the highest page id: ~100 GB): {verdict}"
    )
    return 0 if verdict == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
