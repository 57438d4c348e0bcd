"""Page state costs memory in proportion to the pages events use, not to the pool a node_config declares;
a history stored before ingest refused implausible pools is still judged, never a traceback."""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pytest

from kvtrail.audit.batch import from_dicts
from kvtrail.audit.store import AuditStore
from kvtrail.cli import main
from kvtrail.forensics.replay.engine import ReplayEngine
from kvtrail.forensics.replay.pagestate import INITIAL_PAGES
from tests.conftest import alloc, config, event, producer

D = producer("decode-0", role="decode")
BIG = 2**25  # the probe's pool: ~3.4 GB of page state when the arrays followed the declared pool


def _history(pool_pages: int, top_page: int) -> list[dict]:
    req = {"request_id": "r2", "tenant_id": "t2"}
    return [
        config(0, D, pool_pages=pool_pages),
        alloc(1, [1, 2, 3], prod=D, purpose="decode_reservation"),
        event(
            2,
            "kv_written",
            D,
            request={"request_id": "r1", "tenant_id": "t1"},
            pages=[1, 2, 3],
            token_start=0,
            token_end=48,
            source="transfer_in",
        ),
        event(3, "pages_freed", D, request={"request_id": "r1"}, pages=[1, 2, 3], free_reason="finish"),
        alloc(4, [2, top_page], rid="r2", tenant="t2", prod=D, purpose="decode_reservation"),
        event(5, "kv_read", D, request=req, pages=[2, top_page]),
    ]


@pytest.mark.parametrize("fast", [True, False])
def test_page_arrays_follow_the_highest_page_used_not_the_declared_pool(fast):
    if fast:
        pytest.importorskip("numba")
    engine = ReplayEngine(fast=fast)
    engine.feed(from_dicts(_history(BIG, 5000)))
    [pool] = engine.state.pools.values()
    assert 5001 <= pool.num_entries <= 2 * 5001  # grown on demand (doubling), not 2^25 + 1 entries
    assert sum(a.nbytes for a in pool.arrays()) < 1 << 20
    f1 = [f for f in engine.findings() if f.code == "F1"]
    # page 2 holds r1's KV; page 5000 was never written (stale origin unknown): judged as on a dense pool
    assert sorted((f.pages, f.victim_request_ids) for f in f1 if f.request_id == "r2") == [
        ((2,), ("r1",)),
        ((5000,), (None,)),
    ]


def test_a_small_history_on_a_big_pool_stays_at_the_initial_size():
    engine = ReplayEngine(fast=False)
    engine.feed(from_dicts(_history(BIG, 9)))
    [pool] = engine.state.pools.values()
    assert pool.num_entries == INITIAL_PAGES + 1


def _legacy_store(path, pool_pages: int, events: list[dict]) -> str:
    """A store as a version before the pool check wrote it: the batch passed every other rule, and its
    node_config declares ``pool_pages`` (the chain is the store's own, so it verifies)."""
    with AuditStore(path) as store:
        pre = store.validate(from_dicts(events))  # the rules of the day, on a plausible pool
        t = pre.table
        i = t.schema.get_field_index("pool_pages")
        column = pa.array([pool_pages if v is not None else None for v in t.column(i).to_pylist()], pa.int64())
        legacy = dataclasses.replace(pre, table=t.set_column(i, t.field(i), column))
        store.append_validated([legacy])
    return str(path)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.mark.parametrize("engine", ["replay", "sql"])
def test_findings_on_a_stored_pool_of_2_63_pages_do_not_crash(tmp_path, capsys, engine):
    db = _legacy_store(tmp_path / "legacy.duckdb", 2**63 - 1, _history(64, 9))
    rc, out, err = _run(capsys, "forensics", "findings", "--db", db, "--engine", engine, "--format", "json")
    assert rc == 0, err
    assert "Traceback" not in out + err
    codes = {row["code"] for row in json.loads(out)}
    assert "F1" in codes and "F8" in codes  # 1,024 tokens of pool against a 4,096-token context
