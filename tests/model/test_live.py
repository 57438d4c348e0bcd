"""The model's monitors run live in the service's judge: batches posted to ``kvtrail serve`` (in-process)
are judged as they commit, each fed once; the violations are what ``model validate`` finds on the same
store, ``kvtrail_model_violations_total`` counts them, and a patched history shows none."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvtrail.audit.batch import from_dicts, parse_jsonl, wire_table, write_ipc
from kvtrail.audit.store import AuditStore, read_events
from kvtrail.model.live import LiveMonitors
from kvtrail.model.monitors import Monitors, judge_order
from kvtrail.model.properties import PROPERTIES
from kvtrail.model.validate import validate_store
from kvtrail.service.app import create_app
from kvtrail.service.state import open_state
from kvtrail.sim.fleet.run import write_fleet
from tests.service.conftest import ARROW, auth, make_token
from tests.sim.test_fleet import SMALL

FIXTURES = Path(__file__).parent / "fixtures" / "vulnerable"
CASES = sorted(p.name for p in FIXTURES.iterdir())


def _named(violations) -> set[tuple]:
    """Each violation as (property, request, node): what the live and the whole-history runs must share."""
    return {(v["property"], v["first_event"]["request_id"], v["first_event"]["node"]) for v in violations}


def _metric(text: str) -> dict[tuple[str, str], float]:
    return {
        (s.labels["property"], s.labels["node"]): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "kvtrail_model_violations_total"
    }


def _fleet_batches(db: Path, per_batch: int) -> list[pa.Table]:
    """A stored history's events as its producers would send them: each producer's events in seq order,
    ``per_batch`` to a batch, the producers' batches taken in turn (so nodes' batches interleave)."""
    with AuditStore(db) as store:
        table = read_events(store.con, "TRUE", [])
    table = table.take(judge_order(table))
    keys = list(zip(*(table.column(c).to_pylist() for c in ("cluster", "node", "instance"))))
    seqs = table.column("seq").to_pylist()
    rows: dict[tuple, list[int]] = {}
    for n, k in enumerate(keys):
        rows.setdefault(k, []).append(n)
    rows = {k: sorted(r, key=seqs.__getitem__) for k, r in rows.items()}
    per_producer = [[table.take(r[i : i + per_batch]) for i in range(0, len(r), per_batch)] for r in rows.values()]
    out: list[pa.Table] = []
    for i in range(max(len(b) for b in per_producer)):
        out.extend(b[i] for b in per_producer if i < len(b))
    return out


def _serve_and_post(db: Path, batches: list[pa.Table]) -> tuple[dict, dict, dict]:
    """Post ``batches`` to a fresh service on ``db``; (the live judge's violations and model stats as
    validate's JSON, the metric's samples, GET /v1/model/violations)."""
    state = open_state(db)
    try:
        producer, operator = make_token(state), make_token(state, "operator")
        with TestClient(create_app(state, max_body_bytes=8 << 20)) as client:
            for b in batches:
                r = client.post("/v1/events", content=write_ipc(wire_table(b)), headers=auth(producer, ARROW))
                assert r.status_code == 200, r.text
            assert state.judge.wait_idle(120)
            live: dict = {**state.judge.model.stats()}
            live["violations"] = [v.as_dict() for v in state.judge.model.violations()]
            metric = _metric(client.get("/metrics").text)
            answer = client.get("/v1/model/violations", headers={"Authorization": f"Bearer {operator}"}).json()
        assert state.judge.fed_direct > 0  # the commits were handed over, not read back
        assert live["fed_direct"] > 0  # to the model's monitors too
    finally:
        state.close()
    return live, metric, answer


@pytest.mark.parametrize("case", CASES)
def test_a_vulnerable_history_is_a_violation_live_and_in_the_metric(case, tmp_path):
    batches = [parse_jsonl(p.read_text()) for p in sorted((FIXTURES / case).glob("*.jsonl"))]
    # each producer in two commits, the producers' halves in turn
    halves = [[b.slice(0, b.num_rows // 2), b.slice(b.num_rows // 2)] for b in batches]
    live, metric, answer = _serve_and_post(tmp_path / "s.duckdb", [h[i] for i in (0, 1) for h in halves])
    prop = case.split("-", 1)[1]
    assert prop in {v["property"] for v in live["violations"]}
    assert _named(live["violations"]) == _named(answer["violations"])  # the whole-history run agrees
    assert live["events"] == sum(b.num_rows for b in batches)  # each event fed once
    for (p, node), n in metric.items():
        assert n == sum(1 for v in live["violations"] if (v["property"], v["first_event"]["node"]) == (p, node))
    assert metric[(prop, next(v for v in live["violations"] if v["property"] == prop)["first_event"]["node"])] >= 1
    assert {p for p, _ in metric} == set(PROPERTIES)  # every property listed, at 0 where none


@pytest.mark.parametrize("bugs", [(), ("late_write", "placeholder", "use_after_free", "double_alloc")])
def test_a_fleet_posted_in_interleaved_batches_is_judged_as_validate_judges_its_store(bugs, tmp_path):
    sim = tmp_path / "sim.duckdb"
    with AuditStore(sim) as store:
        write_fleet(replace(SMALL, bugs=bugs), store)
        whole = validate_store(store.con)
    live, metric, answer = _serve_and_post(tmp_path / "svc.duckdb", _fleet_batches(sim, 150))
    assert _named(live["violations"]) == _named(whole["violations"]) == _named(answer["violations"])
    assert sum(metric.values()) == len(live["violations"])
    if not bugs:  # the patched simulator's history: a behaviour the patched model allows
        assert live["violations"] == [] and set(metric.values()) == {0.0} and metric
    else:
        assert {v["property"] for v in live["violations"]} >= {"no_foreign_read", "no_free_before_drain"}


def test_pruning_bounds_the_requests_kept_and_finds_the_same(tmp_path):
    with AuditStore(tmp_path / "sim.duckdb") as store:
        write_fleet(replace(SMALL, bugs=("late_write", "placeholder")), store)
        whole = validate_store(store.con)
    batches = _fleet_batches(tmp_path / "sim.duckdb", 100)
    live = LiveMonitors(horizon_ns=5_000_000_000)  # 5 s of the history's wall time
    held = []
    for b in batches:
        live.feed(b)
        held.append(live.stats()["requests"])
    stats = live.stats()
    assert stats["pruned"] > 0 and max(held) < stats["pruned"] + stats["requests"]
    assert _named(v.as_dict() for v in live.violations()) == _named(whole["violations"])


def _ev(seq: int, kind: str, wall_ms: int, rid: str | None = None, **payload) -> dict:
    e = {
        "schema_version": 1,
        "producer": {
            "cluster": "c",
            "node": "decode-0",
            "role": "decode",
            "engine": "t",
            "engine_version": "1",
            "instance": "i",
        },
        "seq": seq,
        "wall_ns": wall_ms * 1_000_000,
        "mono_ns": wall_ms * 1_000_000,
        "kind": kind,
        **payload,
    }
    if rid is not None:
        e["request"] = {"request_id": rid, "tenant_id": "t-" + rid}
    return e


def test_a_late_write_is_seen_after_the_page_changed_hands_twice():
    """R frees page 3, R2 takes and frees it, then R's write lands: R's free came before the drain, though
    the page's last freer is R2 (a monitor keeping only each page's last freer would miss it)."""
    cfg = {"pool_tokens": 64, "pool_pages": 4, "page_size": 16, "context_tokens": 64}
    events = [
        _ev(0, "node_config", 1, **cfg),
        _ev(1, "pages_allocated", 2, "r1", pages=[3], purpose="decode_reservation"),
        _ev(2, "pages_freed", 3, "r1", pages=[3], free_reason="abort"),
        _ev(3, "pages_allocated", 4, "r2", pages=[3], purpose="decode_reservation"),
        _ev(4, "pages_freed", 5, "r2", pages=[3], free_reason="finish"),
        _ev(5, "kv_written", 6, "r1", pages=[3], token_start=0, token_end=16, source="transfer_in"),
    ]
    mon = Monitors()
    mon.feed(from_dicts(events))
    assert [(v.property, v.request_id, v.seq) for v in mon.violations] == [("no_free_before_drain", "r1", 2)]


def test_a_pool_with_page_ids_near_two_to_the_31_stays_small():
    """A pool may declare up to 2^31 pages; the arrays grow with the pages in use, not with the largest id,
    and the late write is still seen on such pages."""
    top = 2**31 - 1
    cfg = {"pool_tokens": 2**31 * 16, "pool_pages": 2**31, "page_size": 16, "context_tokens": 64}
    events = [
        _ev(0, "node_config", 1, **cfg),
        _ev(1, "pages_allocated", 2, "r1", pages=[3, top], purpose="decode_reservation"),
        _ev(2, "pages_freed", 3, "r1", pages=[3, top], free_reason="abort"),
        _ev(3, "pages_allocated", 4, "r2", pages=[top - 1, top], purpose="decode_reservation"),
        _ev(4, "kv_written", 5, "r1", pages=[top], token_start=0, token_end=16, source="transfer_in"),
        _ev(5, "kv_read", 6, "r2", pages=[top - 1, top]),
    ]
    mon = Monitors()
    mon.feed(from_dicts(events))
    got = {(v.property, v.request_id) for v in mon.violations}
    assert got == {("no_free_before_drain", "r1"), ("no_foreign_read", "r2")}
    pool = next(iter(mon.pools.values()))
    assert pool.owner.nbytes < 64 << 20 and len(pool.sparse) == 2


@pytest.mark.slow
def test_the_reference_stacks_runs_posted_live(stack_runs, tmp_path):
    """The stack's runs (tests/model/conftest.py) posted to a service: the live violations are validate's,
    none for the patched stack."""
    mode, stores = stack_runs
    for n, db in enumerate(stores):
        with AuditStore(db) as store:
            whole = validate_store(store.con)
        live, metric, _ = _serve_and_post(tmp_path / f"svc-{n}.duckdb", _fleet_batches(db, 20))
        assert _named(live["violations"]) == _named(whole["violations"]), db.name
        assert sum(metric.values()) == len(live["violations"])
        assert (live["violations"] == []) == (mode == "patched")
