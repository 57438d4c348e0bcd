"""Online replay tailing a store: findings arrive as batches commit, each once, with stored event ids."""

from __future__ import annotations

from kvtrail.audit.batch import from_dicts
from kvtrail.audit.store import AuditStore
from kvtrail.forensics.online import OnlineReplay
from kvtrail.forensics.replay.engine import replay_store
from tests.forensics.test_replay import pd_request, pd_timeline


def _key(f):
    return (f.code, f.request_id, f.pages, f.evidence)


def test_findings_arrive_batch_by_batch_and_match_a_window_rerun(tmp_path):
    tl = pd_timeline()
    pd_request(tl, "r1", 42, [1], list(range(1, 9)), 120, sent_tokens=1, sent_pages=1)  # F1, F2
    cut = len(tl.events)
    tl.alloc("d", "r2", [20])
    tl.free("d", "r2", [20], "abort")
    tl.alloc("d", "r3", [20])
    tl.write("d", "r2", [20])                                                           # F7
    with AuditStore(tmp_path / "a.duckdb") as store:
        online, con = OnlineReplay(), store.cursor()
        assert online.poll(con) == []                       # an empty store
        store.append(from_dicts(tl.events[:cut]))
        first = online.poll(con)
        assert sorted(f.code for f in first) == ["F1", "F2"]
        assert online.poll(con) == []                       # nothing new, nothing repeated
        # the decode node's later batch: only the late write is new
        store.append(from_dicts([e for e in tl.events[cut:]]))
        second = online.poll(con)
        assert [f.code for f in second] == ["F7"]
        assert online.num_events == len(tl.events)
        assert sorted(map(_key, first + second)) == sorted(map(_key, replay_store(store.con)))
        stored = {tuple(r) for r in store.con.execute("SELECT producer_id, seq FROM events").fetchall()}
        assert all(k in stored for f in first + second for k in f.evidence)


def test_committed_batches_fed_directly_judge_as_read_ones_and_out_of_order_falls_back(tmp_path):
    tl = pd_timeline()
    pd_request(tl, "r1", 42, [1], list(range(1, 9)), 120, sent_tokens=1, sent_pages=1)  # F1, F2
    cut = len(tl.events)
    tl.alloc("d", "r2", [20])
    tl.free("d", "r2", [20], "abort")
    tl.alloc("d", "r3", [20])
    tl.write("d", "r2", [20])                                                           # F7
    with AuditStore(tmp_path / "a.duckdb") as store:
        read, fed, con = OnlineReplay(), OnlineReplay(), store.cursor()
        got_read, got_fed = [], []
        results = [store.append(from_dicts(part)) for part in (tl.events[:cut], tl.events[cut:])]
        for res in results:
            assert fed.feed_committed(con, res.table, dict(res.batches)) is True
            got_fed += fed.poll(con)  # reads nothing: everything was fed
        got_read += read.poll(con)
        assert fed.num_events == read.num_events == len(tl.events)
        assert sorted(map(_key, got_fed)) == sorted(map(_key, got_read)) == sorted(map(_key, replay_store(con)))
        assert fed.feed_committed(con, results[0].table, dict(results[0].batches)) is True  # already fed: no-op
        assert fed.num_events == len(tl.events)
        # A batch that is not its producer's next one is refused (the poll reads it from the store).
        later = OnlineReplay()
        assert later.feed_committed(con, results[1].table, dict(results[1].batches)) is False
        assert later.num_events == 0
