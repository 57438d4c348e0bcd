"""The Arrow body a producer sends (``wire_table``): smaller, and stored exactly as the full batch is."""

from __future__ import annotations

import pyarrow as pa
import pytest

from kvtrail.audit.batch import BATCH_SCHEMA, from_dicts, read_ipc, wire_table, write_ipc
from kvtrail.audit.events import Producer
from kvtrail.audit.store import AuditStore, read_events
from kvtrail.errors import ValidationError
from kvtrail.sim.synth import synth_batches
from tests.conftest import alloc, config, event

PRODUCER = Producer("c1", "decode-0", "decode", "kvtrail-reference", "0.1", "boot-0")


def _synth() -> list[pa.Table]:
    return list(
        synth_batches(
            producer=PRODUCER, num_pages=4096, page_size=16, seed=3, target_page_events=200_000, events_per_batch=500
        )
    )


def _stored(path, tables: list[pa.Table]) -> tuple[list[bytes], pa.Table]:
    s = AuditStore(path)
    try:
        for t in tables:
            s.append(t)
        digests = [bytes(r[0]) for r in s.con.execute("SELECT digest FROM batches ORDER BY batch_no").fetchall()]
        return digests, read_events(s.con)
    finally:
        s.close()


def test_the_wire_body_is_smaller_and_leaves_out_only_null_columns():
    t = _synth()[1]
    w = wire_table(t)
    assert len(write_ipc(w)) < 0.8 * len(write_ipc(t))
    left_out = set(t.column_names) - set(w.column_names)
    assert left_out and all(t.column(n).null_count == t.num_rows for n in left_out)
    assert pa.types.is_dictionary(w.column("node").type) and pa.types.is_dictionary(w.column("kind").type)
    distinct = from_dicts([alloc(i, [i], rid=f"r{i}") for i in range(8)])  # a text column of distinct values
    assert wire_table(distinct).column("request_id").type == pa.string()  # sent as it is
    for name in w.column_names:
        assert w.column(name).cast(t.column(name).type).equals(t.column(name)), name


def test_a_store_holds_the_same_events_and_digests_from_the_wire_body(tmp_path):
    tables = _synth()
    tables.append(from_dicts([config(10**6, prod=None), alloc(10**6 + 1, [1, 2, 3])]))  # another producer
    full = _stored(tmp_path / "full.duckdb", tables)
    sent = _stored(tmp_path / "wire.duckdb", [read_ipc(write_ipc(wire_table(t))) for t in tables])
    assert full[0] == sent[0] and len(full[0]) == len(tables)
    assert full[1].equals(sent[1])


def test_the_envelope_stays_on_the_wire_and_a_bad_event_is_still_named(tmp_path):
    t = from_dicts([config(0), event(1, "pages_allocated", pages=[1])])  # no request: refused
    w = read_ipc(write_ipc(wire_table(t)))
    assert set(BATCH_SCHEMA.names) - set(w.column_names) and "seq" in w.column_names
    s = AuditStore(tmp_path / "a.duckdb")
    try:
        with pytest.raises(ValidationError) as err:
            s.append(w)
        assert err.value.event == 1 and "request" in err.value.field
        assert s.con.execute("SELECT count(*) FROM batches").fetchone() == (0,)
    finally:
        s.close()


def test_a_wire_body_prechecks_to_the_full_batch_with_its_identity_read_once(monkeypatch):
    """One-entry dictionaries (the producer's identity) become the same plain strings a cast gives, and
    the left-out columns the same nulls, whether or not the batch is longer than the nulls kept per type."""
    from kvtrail.audit import validate

    t = _synth()[1]
    full = validate.precheck_batch(t)
    for kept in (validate._NULLS_KEPT_ROWS, 10):
        monkeypatch.setattr(validate, "_NULLS_KEPT_ROWS", kept)
        monkeypatch.setattr(validate, "_NULLS", {})
        w = read_ipc(write_ipc(wire_table(t)))
        normalised, constant = validate._normalise(w)
        assert set(constant) >= {"cluster", "node", "role", "engine", "engine_version", "instance"}
        assert normalised.equals(full.table) and normalised.schema == full.table.schema
        pre = validate.precheck_batch(w)
        assert pre.producers == full.producers == [PRODUCER] and pre.producer_ids == full.producer_ids
        assert (pre.kind_code == full.kind_code).all() and (pre.producer_index == full.producer_index).all()


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [("node", "", "non-empty"), ("role", "janitor", "'janitor' is not one of"), ("kind", "pages_stolen", "unknown")],
)
def test_a_bad_value_sent_once_as_a_dictionary_is_named(tmp_path, field, value, reason):
    t = from_dicts([alloc(1, [1]), alloc(2, [2])])
    w = wire_table(t.set_column(t.column_names.index(field), field, pa.array([value] * t.num_rows)))
    assert pa.types.is_dictionary(w.column(field).type)
    with AuditStore(tmp_path / "a.duckdb") as store, pytest.raises(ValidationError, match=reason) as err:
        store.append(read_ipc(write_ipc(w)))
    assert (err.value.field, err.value.event) == (field, 0)
