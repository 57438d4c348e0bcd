"""A group commit (``AuditStore.validate`` each batch, ``append_validated`` them together): one transaction,
yet every producer's batch is stored exactly as appending it alone would store it (same rows, batch numbers,
digests), and a producer's rows in one stretch are sliced, not copied."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from kvtrail.audit.arrowutil import pick_rows, row_selection
from kvtrail.audit.events import Producer
from kvtrail.audit.store import AuditStore, read_events
from kvtrail.audit.verify import verify_store
from kvtrail.errors import ValidationError
from kvtrail.sim.synth import synth_batches

PRODUCER_NAMES = ["cluster", "node", "role", "engine", "engine_version", "instance"]
NAMES = ", ".join(PRODUCER_NAMES)
PRODUCERS = [Producer("c1", f"decode-{i}", "decode", "kvtrail-synth", "0", f"i{i}") for i in range(3)]


def _streams() -> list[list[pa.Table]]:
    return [
        list(
            synth_batches(
                producer=p,
                num_pages=2_000,
                page_size=16,
                seed=i,
                target_page_events=1_000_000,
                events_per_batch=3_000,
                reuse="lowest",
                decode_fraction=0.6,
            )
        )
        for i, p in enumerate(PRODUCERS)
    ]


def _stored(con) -> tuple[list, list, pa.Table]:
    heads = con.execute(
        "SELECT producer_id, batch_no, first_seq, last_seq, num_events, num_runs, num_page_events, "
        "min_wall_ns, max_wall_ns, prev_digest, digest FROM batches ORDER BY ALL"
    ).fetchall()
    runs = con.execute("SELECT * FROM page_runs ORDER BY ALL").fetchall()
    return heads, runs, read_events(con)  # in (producer_id, seq) order


def test_batches_committed_together_are_stored_as_if_appended_one_by_one(tmp_path):
    streams = _streams()
    rounds = min(map(len, streams))
    assert rounds >= 3
    with AuditStore(tmp_path / "alone.duckdb") as st:
        for k in range(rounds):
            for s in streams:
                st.append(s[k])
        alone = _stored(st.con)
    with AuditStore(tmp_path / "together.duckdb") as st:
        for k in range(rounds):
            res = st.append_validated([st.validate(s[k]) for s in streams])
            assert len(res.batches) == len(PRODUCERS)
            assert res.num_events == sum(s[k].num_rows for s in streams)
            # the committed table names each row's producer by the id it was stored under
            assert res.table is not None
            ids = {r[1:]: r[0] for r in st.con.execute(f"SELECT producer_id, {NAMES} FROM producers").fetchall()}
            want = [ids[tuple(row[n] for n in PRODUCER_NAMES)] for row in res.table.select(PRODUCER_NAMES).to_pylist()]
            assert res.table.column("producer_id").to_pylist() == want
            assert sorted(set(want)) == sorted(pid for pid, _ in res.batches)
        together = _stored(st.con)
    assert together[0] == alone[0]  # batch numbers, seq ranges, counts and the chain's digests
    assert together[1] == alone[1]
    assert together[2].equals(alone[2])
    assert verify_store(tmp_path / "together.duckdb").ok


def test_two_batches_of_one_producer_are_not_committed_together(tmp_path):
    [s, *_] = _streams()
    with AuditStore(tmp_path / "s.duckdb") as st:
        with pytest.raises(ValueError, match="different producers"):
            st.append_validated([st.validate(s[0]), st.validate(s[0])])
        assert st.con.execute("SELECT count(*) FROM batches").fetchone()[0] == 0
        st.append(s[0])  # nothing half-written: the stream goes on where it was
        assert st.con.execute("SELECT count(*) FROM batches").fetchone()[0] == 1


def test_validate_refuses_alone_and_names_the_field(tmp_path):
    streams = _streams()
    bad = streams[1][0].set_column(
        streams[1][0].column_names.index("seq"), "seq", pa.array(np.zeros(streams[1][0].num_rows, np.uint64))
    )
    with AuditStore(tmp_path / "s.duckdb") as st:
        with pytest.raises(ValidationError, match="seq"):
            st.validate(bad)
        res = st.append_validated([st.validate(streams[0][0]), st.validate(streams[2][0])])
        assert len(res.batches) == 2


def test_row_selection_slices_one_stretch_and_takes_the_rest():
    t = pa.table({"x": pa.array(np.arange(10))})
    assert row_selection(np.arange(10), 10) is None
    sel = row_selection(np.arange(3, 7), 10)
    assert sel == slice(3, 7)
    assert pick_rows(t, sel).column("x").to_pylist() == [3, 4, 5, 6]
    idx = row_selection(np.array([1, 4, 5]), 10)
    assert isinstance(idx, np.ndarray)
    assert pick_rows(t, idx).column("x").to_pylist() == [1, 4, 5]
    assert pick_rows(t, row_selection(np.array([], np.int64), 10)).num_rows == 0


def test_an_empty_batch_commits_nothing(tmp_path):
    from kvtrail.audit.batch import BATCH_SCHEMA

    with AuditStore(tmp_path / "s.duckdb") as st:
        assert st.append(BATCH_SCHEMA.empty_table()).num_events == 0
        assert st.append_validated([]).batches == ()
        assert st.con.execute("SELECT count(*) FROM batches").fetchone()[0] == 0
