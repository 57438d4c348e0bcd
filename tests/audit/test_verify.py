"""Tampering with stored rows is caught by `kvtrail audit verify`, naming the first broken link."""

import pytest

from kvtrail.audit.batch import from_dicts
from kvtrail.audit.chain import SignatureChecker, Signer, generate_keypair
from kvtrail.audit.store import AuditStore
from kvtrail.audit.verify import verify_store
from tests.conftest import alloc, config, delete_stored, event, event_table, producer

A, B = producer("prefill-0"), producer("decode-0", role="decode")


def _fill(store):
    store.append(from_dicts([config(0, A), config(0, B)]))
    for b in range(4):
        store.append(
            from_dicts(
                [
                    alloc(1 + 3 * b, [1 + b, 2 + b, 30], rid=f"r{b}", prod=A),
                    alloc(2 + 3 * b, [40, 41], rid=f"q{b}", prod=A),
                    event(3 + 3 * b, "pages_freed", A, pages=[1 + b], free_reason="finish"),
                    alloc(1 + b, [5 + b], rid=f"d{b}", prod=B),
                ]
            )
        )


@pytest.fixture
def filled(store):
    _fill(store)
    assert verify_store(store.con).ok
    return store


def _pid(store, node):
    return store.con.execute("SELECT producer_id FROM producers WHERE node = ?", [node]).fetchone()[0]


def _swap_seqs(con, a: int) -> None:
    t4, t5 = event_table(con, a, 4), event_table(con, a, 5)
    if t4 == t5:
        con.execute(
            f"UPDATE {t4} SET seq = CASE seq WHEN 4 THEN 5 ELSE 4 END WHERE seq IN (4, 5) AND producer_id = ?", [a]
        )
    else:
        con.execute(f"UPDATE {t4} SET seq = 5 WHERE seq = 4 AND producer_id = ?", [a])
        con.execute(f"UPDATE {t5} SET seq = 4 WHERE seq = 5 AND producer_id = ?", [a])


def _sql(template: str, seq: int | None = None):
    def run(con, a: int) -> None:
        table = event_table(con, a, seq) if seq is not None else ""
        con.execute(template.format(a=a, t=table))

    return run


TAMPER = {
    "edit a field": _sql("UPDATE {t} SET purpose = 'mallory' WHERE seq = 4 AND producer_id = {a}", 4),
    # Request fields live in the request dictionary: edit an identity, or point an event at another one.
    "edit a request identity": _sql(
        "UPDATE events_requests SET tenant_id = 'mallory' WHERE request_no = "
        "(SELECT request_no FROM {t} WHERE seq = 4 AND producer_id = {a})",
        4,
    ),
    "point an event at another request": _sql(
        "UPDATE {t} SET request_no = (SELECT max(request_no) FROM events_requests) WHERE seq = 4 AND producer_id = {a}",
        4,
    ),
    "edit a page run": _sql("UPDATE page_runs SET page_start = page_start + 1 WHERE seq = 5 AND producer_id = {a}"),
    "delete an event row": _sql("DELETE FROM {t} WHERE seq = 6 AND producer_id = {a}", 6),
    "delete a page run": _sql("DELETE FROM page_runs WHERE seq = 4 AND producer_id = {a} AND pos = 0"),
    "reorder two events": _swap_seqs,
    "reorder page runs": _sql(
        "UPDATE page_runs SET pos = CASE pos WHEN 0 THEN 2 ELSE 0 END WHERE seq = 4 "
        "AND pos IN (0, 2) AND producer_id = {a}"
    ),
    "move an event to another batch": _sql("UPDATE {t} SET batch_no = 1 WHERE seq = 7 AND producer_id = {a}", 7),
    "insert a forged event": _sql(
        "INSERT INTO {t} SELECT * REPLACE (seq + 100 AS seq) FROM {t} WHERE seq = 4 AND producer_id = {a}", 4
    ),
    "edit a batch header": _sql(
        "UPDATE batches SET num_events = num_events - 1 WHERE batch_no = 2 AND producer_id = {a}"
    ),
    "edit a digest": _sql("UPDATE batches SET digest = sha256('x')::BLOB WHERE batch_no = 2 AND producer_id = {a}"),
}


@pytest.mark.parametrize("how", list(TAMPER), ids=list(TAMPER))
def test_each_kind_of_tampering_is_caught(filled, how):
    a = _pid(filled, "prefill-0")
    assert filled.con.execute("SELECT kind FROM events WHERE seq = 4 AND producer_id = ?", [a]).fetchone() == (
        "pages_allocated",
    )  # the event the edits rewrite has a purpose and a request
    TAMPER[how](filled.con, a)
    report = verify_store(filled.con)
    assert not report.ok
    first = report.first_problem
    assert first.producer_id == a
    assert first.node == "prefill-0" or first.node is None
    # the other producer's chain is untouched
    assert not [p for p in report.problems if p.producer_id == _pid(filled, "decode-0")]


def test_deleting_a_whole_batch_names_the_missing_link(filled):
    a = _pid(filled, "prefill-0")
    delete_stored(filled.con, "producer_id = ? AND batch_no = 2", [a])
    report = verify_store(filled.con)
    assert str(report.first_problem).endswith("missing link: batch 2 is absent (deleted?)")
    assert report.first_problem.batch_no == 3


def test_rewriting_a_batch_and_its_digest_breaks_the_next_link(filled):
    a = _pid(filled, "prefill-0")
    # An attacker who recomputes batch 2's digest still cannot make batch 3's prev_digest match.
    filled.con.execute("UPDATE batches SET digest = sha256('forged')::BLOB WHERE producer_id = ? AND batch_no = 2", [a])
    problems = verify_store(filled.con).problems
    assert any(p.batch_no == 3 and "broken link" in p.what for p in problems)


def test_signed_chain_verifies_only_with_the_right_key(tmp_path):
    priv, pub = tmp_path / "k.pem", tmp_path / "k.pub"
    generate_keypair(priv, pub)
    other_priv, other_pub = tmp_path / "o.pem", tmp_path / "o.pub"
    generate_keypair(other_priv, other_pub)
    with AuditStore(tmp_path / "s.duckdb", signer=Signer.from_file(priv)) as s:
        _fill(s)
    good = verify_store(tmp_path / "s.duckdb", checker=SignatureChecker(pub.read_bytes()))
    assert good.ok and good.signatures_checked == 10  # 2 config batches + 4 rounds x 2 producers
    bad = verify_store(tmp_path / "s.duckdb", checker=SignatureChecker(other_pub.read_bytes()))
    assert not bad.ok and "signature" in bad.first_problem.what


def test_unsigned_store_fails_a_signature_check(filled, tmp_path):
    generate_keypair(tmp_path / "k.pem", tmp_path / "k.pub")
    report = verify_store(filled.con, checker=SignatureChecker((tmp_path / "k.pub").read_bytes()))
    assert not report.ok


def test_coverage_reports_unexplained_sequence_gaps(store):
    store.append(from_dicts([config(0), alloc(1, [1]), alloc(5, [2])]))  # seq 2..4 never arrived
    report = verify_store(store.con)
    assert report.ok  # the chain itself is intact
    (cov,) = report.coverage
    assert (cov.first_seq, cov.last_seq, cov.missing_events, cov.unexplained) == (0, 5, 3, 3)
