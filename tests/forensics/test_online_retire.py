"""A long-running online replay holds what is live, not all it has seen: request ids the horizon has passed
retire (their cross-node findings kept), each node keeps its latest rate samples, and the findings stay
those of a replay of the whole history."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from kvtrail.audit.events import Producer
from kvtrail.forensics.online import OnlineReplay
from kvtrail.forensics.replay.engine import ReplayEngine
from kvtrail.forensics.replay.retire import Retirement
from kvtrail.sim.fleet.run import fleet_batches
from kvtrail.sim.synth import synth_batches
from tests.service.test_judge import FLEET

MS = 1_000_000


def _synth(role: str, i: int, target: int) -> list[pa.Table]:
    prod = Producer("c", f"{role}-{i}", role, "kvtrail-reference", "0.1", f"i{i}")
    return list(
        synth_batches(
            producer=prod,
            num_pages=2048,
            page_size=16,
            seed=i,
            target_page_events=target,
            events_per_batch=400,
            chunk_tokens=256,
            prompt_median_tokens=96,
            min_prompt_tokens=16,
            decode_fraction=0.2,
            mean_decode_tokens=16,
        )
    )


def _feed_in_time(online: OnlineReplay, commits: list[list[pa.Table]]):
    """Feed each commit's batches and poll; yields after each poll."""
    for commit in commits:
        for t in commit:
            online.engine.feed(t)
            online.retirement.seen(t)
        online.poll(None, read_store=False)  # type: ignore[arg-type]  # nothing is read from a store
        yield


def _held(online: OnlineReplay) -> dict[str, int]:
    s, j = online.engine.state, online.engine.state.joins
    return {
        "slots": len(s.requests),
        "requests": len(s.request_index),
        "tenants": len(s.tenants),
        "named": len(s.named),
        "forward_writes": len(j.forward_writes),
        "deferred": sum(map(len, j._deferred.values())),
        "samples": sum(len(x.rates) for x in j._samples.values()),
        "seen": len(online.retirement.last_seen),
        "released": sum(len(p.released) for p in s.pools.values()),
    }


@pytest.fixture(scope="module")
def streams():
    return [_synth("prefill", 0, 240_000), _synth("decode", 1, 240_000)]


def test_what_a_long_stream_leaves_held_stays_bounded_and_grows_without_retirement(streams):
    span = max(pc.max(t.column("wall_ns")).as_py() for s in streams for t in s) - min(
        pc.min(s[0].column("wall_ns")).as_py() for s in streams
    )
    horizon = span // 40  # the stream spans forty horizons
    online = OnlineReplay()
    online.retirement = Retirement(horizon, samples=2_000, deferred=500, compact_floor=256)
    commits = _time_slices([t for s in streams for t in s], span // 200)
    peaks: list[dict[str, int]] = []
    for _ in _feed_in_time(online, commits):
        peaks.append(_held(online))
    keeper = ReplayEngine()  # what a replay holds without retirement
    for commit in commits:
        for t in commit:
            keeper.feed(t)
    keeper.findings()
    requests = sum(len(set(pc.drop_null(t.column("request_id")).to_pylist())) for s in streams for t in s)
    total = len(keeper.state.request_index)
    assert total >= 10_000 and requests >= total  # tens of thousands of requests streamed
    ks, kj = keeper.state, keeper.state.joins
    assert len(ks.requests) == len(ks.tenants) == len(ks.named) == total  # without retirement: one per request
    assert len(kj.forward_writes) >= 15_000  # and one per forward write
    half = len(peaks) // 2
    first = {name: max(p[name] for p in peaks[:half]) for name in peaks[0]}
    second = {name: max(p[name] for p in peaks[half:]) for name in peaks[0]}
    for name, most in second.items():  # the second half holds no more than the first: a plateau
        assert most <= first[name] * 1.25 + 64, (name, first[name], most)
    assert second["requests"] * 8 < total and second["slots"] * 4 < total
    assert second["samples"] <= 2_000 and second["deferred"] <= 500
    assert online.retirement.retired >= total // 2 and online.retirement.compactions >= 2
    assert online.retirement.late_events == 0
    # what it found is what the replay that kept everything found (page findings: final when reported)
    assert [(f.code, f.request_id, f.pages, f.evidence, f.detail) for f in online.found] == [
        (f.code, f.request_id, f.pages, f.evidence, f.detail) for f in keeper.findings()
    ]


def _time_slices(tables: list[pa.Table], step_ns: int) -> list[list[pa.Table]]:
    """The producers' events cut into commits of ``step_ns`` of wall time each, in time order."""
    lo = min(pc.min(t.column("wall_ns")).as_py() for t in tables)
    hi = max(pc.max(t.column("wall_ns")).as_py() for t in tables)
    out = []
    for start in range(lo, hi + 1, step_ns):
        part = []
        for t in tables:
            w = t.column("wall_ns")
            cut = t.filter(pc.and_(pc.greater_equal(w, start), pc.less(w, start + step_ns)))
            if cut.num_rows:
                part.append(cut)
        out.append(part)
    return out


def _full(f) -> tuple:
    return (f.code, f.node, f.request_id, f.tenant_id, f.victim_request_ids, f.pages, f.first_ns, f.last_ns)


def test_findings_of_a_retiring_judge_equal_a_replay_of_the_whole_history():
    """A fleet with planted incidents (F1, F2, F4-F8) over three minutes, fed as commits of one second while
    request ids retire ten seconds after their last event and indices are compacted: the findings, cross-node
    ones included, are those of one replay of everything, detail and severity alike."""
    cfg = dataclasses.replace(FLEET, hours=0.05, cache_namespaces=False)
    tables = list(fleet_batches(cfg, {}))
    online = OnlineReplay()
    online.retirement = Retirement(10_000 * MS, compact_floor=1)
    for _ in _feed_in_time(online, _time_slices(tables, 1_000 * MS)):
        pass
    whole = ReplayEngine()
    for t in tables:
        whole.feed(t)
    expected = whole.findings()
    r = online.retirement
    assert r.retired > 500 and r.compactions >= 2 and r.late_events == 0
    assert len(online.engine.state.request_index) * 4 < r.retired
    assert any(f.code in ("F2", "F4") for f in r.frozen)  # cross-node findings of retired requests kept
    assert {"F1", "F2", "F4", "F6", "F7"} <= {f.code for f in expected}
    got = [(_full(f), f.severity, f.evidence, f.detail) for f in online.found]
    assert got == [(_full(f), f.severity, f.evidence, f.detail) for f in expected]


def test_an_event_older_than_the_horizon_is_counted():
    tables = _synth("decode", 3, 6_000)
    online = OnlineReplay()
    span = pc.max(tables[-1].column("wall_ns")).as_py() - pc.min(tables[0].column("wall_ns")).as_py()
    online.retirement = Retirement(span // 8)
    for _ in _feed_in_time(online, _time_slices(tables, span // 100)):
        pass
    assert online.retirement.retired > 0 and online.retirement.late_events == 0
    old = tables[0].slice(0, 5)
    online.retirement.seen(old)
    assert online.retirement.late_events == 5


def test_a_store_read_whole_at_start_retires_what_the_horizon_passed_at_once():
    """A restarted judge reads the store in one table: ids the horizon passed retire at its first poll (each
    id dated by its own newest event), with the findings of a replay of everything."""
    tables = _synth("decode", 4, 30_000)
    whole = pa.concat_tables(tables)
    span = pc.max(whole.column("wall_ns")).as_py() - pc.min(whole.column("wall_ns")).as_py()
    online = OnlineReplay()
    online.retirement = Retirement(span // 10)
    online.engine.feed(whole)
    online.retirement.seen(whole)
    online.poll(None, read_store=False)
    everything = ReplayEngine()
    everything.feed(whole)
    total = len(everything.state.request_index)
    assert online.retirement.retired > total // 2
    assert len(online.engine.state.request_index) < total // 4
    assert [(f.code, f.request_id, f.evidence) for f in online.found] == [
        (f.code, f.request_id, f.evidence) for f in everything.findings()
    ]
