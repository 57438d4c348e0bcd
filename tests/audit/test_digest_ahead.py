"""Large batches have their chain digests, run encoding and most validation rules computed by a digest thread
beside the inserts: the digests and signatures are the same as computed inline, a commit that fails leaves
the chain where it was, and a batch that breaks a rule raises what validation raises and writes nothing."""

from __future__ import annotations

import pyarrow as pa
import pytest

from kvtrail.audit import layout
from kvtrail.audit import store as store_mod
from kvtrail.audit.chain import SignatureChecker, Signer, generate_keypair
from kvtrail.audit.events import Producer
from kvtrail.audit.store import AuditStore
from kvtrail.audit.validate import validate_batch
from kvtrail.audit.verify import verify_store
from kvtrail.errors import ValidationError
from kvtrail.sim.synth import synth_batches

PROD = Producer("c1", "decode-0", "decode", "kvtrail-synth", "0", "i1")


def _batches() -> list:
    out = list(
        synth_batches(
            producer=PROD,
            num_pages=4_000,
            page_size=16,
            seed=3,
            target_page_events=8_000_000,
            events_per_batch=20_000,
            reuse="lowest",
            decode_fraction=0.6,
        )
    )
    assert len(out) >= 3 and all(b.num_rows >= store_mod._DIGEST_AHEAD_EVENTS for b in out[:-1])
    return out


def _heads(con) -> list[tuple]:
    return con.execute("SELECT batch_no, digest, signature FROM batches ORDER BY batch_no").fetchall()


def test_digests_beside_the_inserts_equal_the_inline_ones(tmp_path, monkeypatch):
    priv, pub = tmp_path / "k.pem", tmp_path / "k.pub"
    generate_keypair(priv, pub)
    batches = _batches()
    heads = {}
    for mode, threshold in (("ahead", store_mod._DIGEST_AHEAD_EVENTS), ("inline", 10**12)):
        monkeypatch.setattr(store_mod, "_DIGEST_AHEAD_EVENTS", threshold)
        with AuditStore(tmp_path / f"{mode}.duckdb", signer=Signer.from_file(priv)) as st:
            for b in batches:
                st.append(b)
            heads[mode] = _heads(st.con)
            assert (st._digest_pool is not None) == (mode == "ahead")
        report = verify_store(tmp_path / f"{mode}.duckdb", checker=SignatureChecker(pub.read_bytes()))
        assert report.ok and report.signatures_checked == len(batches)
    # Ed25519 signatures are deterministic: the same digests give the same signatures.
    assert heads["ahead"] == heads["inline"]


def test_a_failed_large_commit_leaves_the_chain_where_it_was(tmp_path, monkeypatch):
    batches = _batches()
    real = layout.append_kinds

    def failing(*args, **kwargs):
        raise RuntimeError("disk full")

    with AuditStore(tmp_path / "s.duckdb") as st:
        st.append(batches[0])
        before = _heads(st.con)
        monkeypatch.setattr(store_mod, "append_kinds", failing)
        with pytest.raises(RuntimeError, match="disk full"):
            st.append(batches[1])
        assert _heads(st.con) == before
        monkeypatch.setattr(store_mod, "append_kinds", real)
        for b in batches[1:]:
            st.append(b)
    report = verify_store(tmp_path / "s.duckdb")
    assert report.ok and report.batches_checked == len(batches)


def _with_value(batch, name: str, row: int, value):
    """``batch`` with column ``name`` set to ``value`` at ``row``."""
    col = batch.column(name).to_pylist()
    col[row] = value
    return batch.set_column(batch.schema.get_field_index(name), name, pa.array(col, batch.schema.field(name).type))


def test_a_large_batch_breaking_a_rule_checked_beside_the_inserts_writes_nothing(tmp_path):
    batches = _batches()
    with AuditStore(tmp_path / "s.duckdb") as st:
        st.append(batches[0])
        before = _heads(st.con)
        rows_before = st.con.execute("SELECT count(*) FROM events").fetchone()
        runs_before = st.con.execute("SELECT count(*) FROM page_runs").fetchone()
        purposes = batches[1].column("purpose").to_pylist()
        row = next(i for i, p in enumerate(purposes) if p is not None and i > 1000)
        bad_value = _with_value(batches[1], "purpose", row, "stolen")
        for bad in (bad_value, batches[0]):  # a value rule; a sequence number the store already holds
            with pytest.raises(ValidationError) as got:
                validate_batch(bad, st._state)
            with pytest.raises(ValidationError) as raised:
                st.append(bad)
            assert str(raised.value) == str(got.value)
            assert ("stolen" in str(got.value)) == (bad is bad_value)
            assert _heads(st.con) == before
            assert st.con.execute("SELECT count(*) FROM events").fetchone() == rows_before
            assert st.con.execute("SELECT count(*) FROM page_runs").fetchone() == runs_before
        for b in batches[1:]:
            st.append(b)
    report = verify_store(tmp_path / "s.duckdb")
    assert report.ok and report.batches_checked == len(batches)
