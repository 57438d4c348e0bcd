"""F11: a transfer that outlives its decode node's release timeout, the same through both engines."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtrail.forensics.findings import CODES
from tests.conftest import T0
from tests.forensics.test_agreement import both_engines
from tests.forensics.test_replay import Timeline

SECOND_NS = 10**9
BASE = T0 + SECOND_NS  # transfers start after the nodes' configurations


def _pd(timeout_s: float | None, prefill_timeout_s: float | None = 1.0) -> Timeline:
    tl = Timeline()
    for name, role, timeout in (("p", "prefill", prefill_timeout_s), ("d", "decode", timeout_s)):
        tl.node(name, role)
        if timeout is not None:  # a second config of the node stating its timeout
            tl.add(
                name,
                "node_config",
                pool_tokens=512,
                pool_pages=32,
                page_size=16,
                context_tokens=512,
                release_timeout_ns=int(timeout * SECOND_NS),
            )
    return tl


def _transfer(
    tl: Timeline, rid: str, tid: int, sends_at_s: list[float], receipt_at_s: float | None, reserve: bool = True
) -> None:
    """A reservation at BASE, sends and a receipt at the given seconds after it."""

    def at(ev, s):
        ev["wall_ns"] = BASE + int(s * SECOND_NS)

    if reserve:
        at(tl.add("d", "transfer_reserved", rid, tid, pages=[1, 2], num_tokens=32), 0)
    for i, s in enumerate(sends_at_s):
        at(
            tl.add(
                "p",
                "transfer_sent",
                rid,
                tid,
                pages=[3 + i],
                dst_pages=[1 + i],
                num_tokens=16,
                is_last_chunk=i == len(sends_at_s) - 1,
            ),
            s,
        )
    if receipt_at_s is not None:
        at(
            tl.add("d", "transfer_received", rid, tid, pages=[1, 2], num_tokens=16 * len(sends_at_s), status="ok"),
            receipt_at_s,
        )


def _sorted(events):
    """In time order, each producer's events numbered again in that order."""
    out, seqs = sorted(events, key=lambda e: e["wall_ns"]), {}
    for e in out:
        node = e["producer"]["node"]
        e["seq"] = seqs.get(node, 0)
        e["mono_ns"] = 1000 + e["seq"]
        seqs[node] = e["seq"] + 1
    return out


def test_a_transfer_longer_than_the_decode_timeout_is_f11_in_both_engines():
    tl = _pd(timeout_s=2.0)
    _transfer(tl, "slow", 7, [1.0, 2.5], 3.5)  # 2.5 s from the first send to the receipt
    _transfer(tl, "quick", 8, [1.0, 1.5], 2.0)
    replay, sql = both_engines(_sorted(tl.events))
    assert replay == sql
    late = [f for f in replay if f.code == "F11"]
    assert [(f.request_id, f.node, f.severity) for f in late] == [("slow", "d", "high")]
    f = late[0]
    assert (f.first_ns, f.last_ns) == (BASE + SECOND_NS, BASE + int(3.5 * SECOND_NS))
    assert "2.500 s" in f.detail and "after 2 s" in f.detail and f.title == CODES["F11"].title
    assert len(f.evidence) == 4  # two sends, the receipt, the decode node's config


def test_no_timeout_stated_no_receipt_or_no_send():
    tl = _pd(timeout_s=None, prefill_timeout_s=0.1)  # only prefill states one: not the decode node's
    _transfer(tl, "a", 1, [1.0, 9.0], 10.0)
    assert not [f for f in both_engines(_sorted(tl.events))[0] if f.code == "F11"]
    tl = _pd(timeout_s=2.0)
    _transfer(tl, "b", 2, [1.0, 4.0], None)  # no receipt: the reservation names the decode node
    _transfer(tl, "c", 3, [], 9.0)  # nothing sent: no transfer call to time
    replay, sql = both_engines(_sorted(tl.events))
    assert replay == sql
    assert [(f.request_id, f.last_ns) for f in replay if f.code == "F11"] == [("b", BASE + 4 * SECOND_NS)]


def test_a_consistent_but_slow_transfer_is_only_f11():
    tl = _pd(timeout_s=1.0)
    _transfer(tl, "slow", 7, [1.0, 1.2], 3.0)
    replay, sql = both_engines(_sorted(tl.events))
    assert [f.code for f in replay] == ["F11"] == [f.code for f in sql]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_both_engines_agree_on_random_transfer_timings(data):
    tl = _pd(timeout_s=data.draw(st.sampled_from([None, 0.5, 1.0, 2.0])))
    for i in range(data.draw(st.integers(1, 5))):
        sends = data.draw(st.lists(st.floats(0.0, 4.0, allow_nan=False).map(lambda x: round(x, 3)), max_size=3))
        receipt = data.draw(st.one_of(st.none(), st.floats(0.0, 5.0).map(lambda x: round(x, 3))))
        _transfer(tl, f"r{i % 3}", data.draw(st.integers(1, 3)), sends, receipt, data.draw(st.booleans()))
    replay, sql = both_engines(_sorted(tl.events))
    assert [f for f in replay if f.code == "F11"] == [f for f in sql if f.code == "F11"]
    assert replay == sql
