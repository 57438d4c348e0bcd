"""The request dictionary of store format 3: each request identity is stored once under a number, the
events read back exactly as they were sent, and the numbers stay right across reopening, a forgotten
cache, a failed commit, a prune and batches with many distinct values."""

from __future__ import annotations

import pytest

from kvtrail.audit import layout
from kvtrail.audit import requests as requests_mod
from kvtrail.audit import store as store_mod
from kvtrail.audit.batch import from_dicts
from kvtrail.audit.layout import REQUESTS_TABLE
from kvtrail.audit.retention import prune
from kvtrail.audit.store import AuditStore
from kvtrail.audit.verify import verify_store
from tests.conftest import T0, config, event, producer, stored_events

P = producer("decode-0", "decode")


def _identity(rid, tenant="acme", transfer=None, key=None):
    req = {"request_id": rid}
    if tenant is not None:
        req["tenant_id"] = tenant
    if transfer is not None:
        req["transfer_id"] = transfer
    if key is not None:
        req["api_key_id"] = key
    return req


def _events(seq0: int, rids: list[str], **ident) -> list[dict]:
    out = []
    for k, rid in enumerate(rids):
        seq = seq0 + 2 * k
        out.append(
            event(
                seq, "pages_allocated", P, request=_identity(rid, **ident), pages=[1 + k % 60], purpose="decode_growth"
            )
        )
        out.append(event(seq + 1, "kv_read", P, request=_identity(rid, **ident), pages=[1 + k % 60]))
    return out


def _dictionary(con) -> list[tuple]:
    return con.execute(
        f"SELECT request_no, request_id, transfer_id, tenant_id, api_key_id FROM {REQUESTS_TABLE} ORDER BY request_no"
    ).fetchall()


def _sent_requests(batches: list[list[dict]]) -> list[dict | None]:
    return [e.get("request") for b in batches for e in b]


def _stored_requests(path) -> list[dict | None]:
    out = []
    for e in stored_events(path):
        req = e.get("request")
        out.append({k: v for k, v in req.items() if v is not None} if req else None)
    return out


def test_identities_are_stored_once_and_read_back_as_sent(tmp_path):
    path = tmp_path / "s.duckdb"
    b0 = [config(0, P)] + _events(1, ["a", "b", "a"])
    b1 = _events(7, ["b", "c"]) + [event(11, "pages_freed", P, pages=[5], free_reason="eviction")]
    # The same request id with and without a tenant, and with a transfer id: three identities.
    b2 = _events(12, ["a"], tenant=None) + _events(14, ["a"], transfer=7, key="k1")
    with AuditStore(path) as st:
        for b in (b0, b1, b2):
            st.append(from_dicts(b))
        rows = _dictionary(st.con)
        assert [r[1:] for r in rows] == [
            ("a", None, "acme", None),
            ("b", None, "acme", None),
            ("c", None, "acme", None),
            ("a", None, None, None),
            ("a", 7, "acme", "k1"),
        ]
        assert [r[0] for r in rows] == list(range(5))
        # An eviction names no request: its row holds no number.
        assert st.con.execute("SELECT count(*) FROM events_pages_freed WHERE request_no IS NULL").fetchone() == (1,)
    assert _stored_requests(path) == _sent_requests([b0, b1, b2])
    assert verify_store(path).ok


def test_numbers_continue_after_a_reopen_and_a_forgotten_identity_costs_one_row(tmp_path, monkeypatch):
    path = tmp_path / "s.duckdb"
    b0 = [config(0, P)] + _events(1, ["a", "b"])
    with AuditStore(path) as st:
        st.append(from_dicts(b0))
    b1 = _events(5, ["a", "z"])  # "a" again, after the reopen: the new writer does not remember it
    with AuditStore(path) as st:
        st.append(from_dicts(b1))
        assert [r[:2] for r in _dictionary(st.con)] == [(0, "a"), (1, "b"), (2, "a"), (3, "z")]
    monkeypatch.setattr(requests_mod, "REQUEST_CACHE_MAX", 2)
    b2 = _events(9, ["a", "q", "r"])  # a third writer: "a" is new to it
    b3 = _events(15, ["s"])  # past the bound: the writer forgets all but what this batch numbered...
    b4 = _events(17, ["a", "s"])
    with AuditStore(path) as st:
        for b in (b2, b3, b4):
            st.append(from_dicts(b))
        rows = _dictionary(st.con)
        assert [r[0] for r in rows] == list(range(len(rows)))
        assert [r[1] for r in rows] == ["a", "b", "a", "z", "a", "q", "r", "s", "a"]  # ...so "a" is numbered anew
    assert _stored_requests(path) == _sent_requests([b0, b1, b2, b3, b4])
    assert verify_store(path).ok


def test_a_failed_commit_leaves_no_number_behind(tmp_path, monkeypatch):
    path = tmp_path / "s.duckdb"
    real = layout.append_kinds

    def failing(con, events, kind_code, request_no, requests=None):
        real(con, events, kind_code, request_no, requests)  # the dictionary rows are in, then the commit fails
        raise RuntimeError("disk full")

    with AuditStore(path) as st:
        st.append(from_dicts([config(0, P)] + _events(1, ["a"])))
        monkeypatch.setattr(store_mod, "append_kinds", failing)
        with pytest.raises(RuntimeError, match="disk full"):
            st.append(from_dicts(_events(3, ["b", "a"])))
        monkeypatch.setattr(store_mod, "append_kinds", real)
        assert [r[:2] for r in _dictionary(st.con)] == [(0, "a")]
        st.append(from_dicts(_events(3, ["b", "a"])))  # "b" gets a number that exists
        assert [r[:2] for r in _dictionary(st.con)] == [(0, "a"), (1, "b")]
    assert [r["request_id"] for r in _stored_requests(path) if r] == ["a", "a", "b", "b", "a", "a"]


def test_a_prune_deletes_the_identities_only_pruned_events_named(tmp_path):
    path = tmp_path / "s.duckdb"
    old = [config(0, P)] + [
        event(s, "pages_allocated", P, wall_ns=T0 + s, request=_identity(r), pages=[s], purpose="decode_growth")
        for s, r in ((1, "gone"), (2, "kept"))
    ]
    new = [event(s, "kv_read", P, wall_ns=T0 + 10**12 + s, request=_identity("kept"), pages=[2]) for s in (3, 4)]
    with AuditStore(path) as st:
        st.append(from_dicts(old))
        st.append(from_dicts(new))
        res = prune(st, T0 + 10**9)
        assert res.num_batches == 1
        assert [r[1] for r in _dictionary(st.con)] == ["kept"]  # "gone" left with its events
        # The writer forgot what the prune deleted: "gone" coming back gets a number that exists.
        st.append(from_dicts([event(5, "kv_read", P, wall_ns=T0 + 10**12 + 5, request=_identity("gone"), pages=[1])]))
        assert [r[1] for r in _dictionary(st.con)] == ["kept", "gone"]
    assert [r["request_id"] for r in _stored_requests(path) if r] == ["kept", "kept", "gone"]


def test_many_distinct_values_in_one_batch(tmp_path, monkeypatch):
    monkeypatch.setattr(requests_mod, "_KEY_LIMIT", 64)  # forces the renumbering a huge batch needs
    path = tmp_path / "s.duckdb"
    batch = [config(0, P)]
    for k in range(40):
        batch.append(
            event(
                1 + k,
                "kv_read",
                P,
                request=_identity(f"r{k % 13}", tenant=f"t{k % 7}", transfer=k % 5, key=f"k{k % 3}"),
                pages=[1 + k],
            )
        )
    # A second batch whose first event has a request and whose evictions have none.
    more = [event(41 + k, "kv_read", P, request=_identity(f"s{k}", transfer=k), pages=[1 + k]) for k in range(20)]
    more[5:5] = [event(100, "pages_freed", P, pages=[3], free_reason="eviction")]
    for k, e in enumerate(more):
        e["seq"] = 41 + k
    with AuditStore(path) as st:
        st.append(from_dicts(batch))
        distinct = {(f"r{k % 13}", k % 5, f"t{k % 7}", f"k{k % 3}") for k in range(40)}
        assert len(_dictionary(st.con)) == len(distinct) and {r[1:] for r in _dictionary(st.con)} == distinct
        st.append(from_dicts(more))
        assert len(_dictionary(st.con)) == len(distinct) + 20
        assert st.con.execute("SELECT count(*) FROM events_pages_freed WHERE request_no IS NULL").fetchone() == (1,)
    assert _stored_requests(path) == _sent_requests([batch, more])
