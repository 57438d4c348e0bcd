"""The store's transparency log: kept at each commit, built for older stores, and `audit verify --checkpoint`
catching truncation, rewrites and forks against a signed checkpoint, with no saved chain heads."""

from __future__ import annotations

import json
import shutil

import duckdb
import pytest

from kvtrail.audit.batch import parse_jsonl_lines
from kvtrail.audit.chain import SignatureChecker, Signer, generate_keypair
from kvtrail.audit.merkle import Tree, verify_consistency
from kvtrail.audit.note import Checkpoint, parse_note, sign_checkpoint, verify_log_signature
from kvtrail.audit.store import AuditStore, connect_readonly
from kvtrail.audit.tlog import FRONTIER_KEY, ORIGIN_KEY, LogView, read_leaves, verify_against
from tests.conftest import alloc, config, delete_stored, producer, run_cli

P, D = producer("prefill-0"), producer("decode-0", role="decode")


def _table(events):
    return parse_jsonl_lines("".join(json.dumps(e) + "\n" for e in events).encode())[0]


def _fill(path, batches: int, *, start: int = 1, tag: str = "r") -> None:
    with AuditStore(path) as s:
        if start == 1:
            s.append(_table([config(0, P), config(0, D)]))
        for b in range(start, start + batches):
            s.append(_table([alloc(b, [b], rid=f"{tag}{b}", prod=P), alloc(b, [b + 1], rid=f"d{tag}{b}", prod=D)]))


@pytest.fixture
def keys(tmp_path):
    generate_keypair(tmp_path / "k.pem", tmp_path / "k.pub")
    return tmp_path / "k.pem", tmp_path / "k.pub"


def _checkpoint(path, keys, out):
    con = connect_readonly(path)
    try:
        note = sign_checkpoint(LogView(con).checkpoint(), Signer.from_file(keys[0]))
    finally:
        con.close()
    out.write_text(note.text())
    return note


def test_each_batch_is_a_leaf_in_commit_order_and_the_frontier_matches_the_leaves(tmp_path):
    db = tmp_path / "a.duckdb"
    _fill(db, 4)
    con = connect_readonly(db)
    leaves = read_leaves(con)
    batches = con.execute("SELECT producer_id, batch_no, digest FROM batches ORDER BY committed_ns").fetchall()
    assert len(leaves) == len(batches) == 10  # a group commit of two producers is two batches, two leaves
    assert sorted((leaf.producer_id, leaf.batch_no, leaf.digest) for leaf in leaves) == sorted(
        (p, b, bytes(d)) for p, b, d in batches
    )
    # one commit holds both producers' batches: ordered by producer id inside it
    pairs = [(leaves[i].producer_id, leaves[i + 1].producer_id) for i in range(0, 10, 2)]
    assert all(a < b for a, b in pairs)
    (frontier,) = con.execute("SELECT value FROM meta WHERE key = ?", [FRONTIER_KEY]).fetchone()
    from kvtrail.audit.merkle import Frontier

    assert Frontier.decode(frontier).root() == Tree.of([leaf.digest for leaf in leaves]).root()
    con.close()


def test_an_older_store_gets_the_same_tree_on_its_next_writable_open(tmp_path):
    db = tmp_path / "a.duckdb"
    _fill(db, 3)
    con = connect_readonly(db)
    before = LogView(con).checkpoint()
    con.close()
    with duckdb.connect(str(db)) as con:  # what a store written before the log looks like
        con.execute("DELETE FROM meta WHERE key IN (?, ?)", [FRONTIER_KEY, ORIGIN_KEY])
    con = connect_readonly(db)
    assert LogView(con).checkpoint() == before  # a read-only reader derives it from the batches
    con.close()
    _fill(db, 2, start=4)  # the writable open builds it, then commits extend it
    con = connect_readonly(db)
    view = LogView(con)
    assert view.size == before.size + 4
    assert verify_consistency(
        before.size, view.size, before.root, view.tree.root(), view.tree.consistency_proof(before.size, view.size)
    )
    con.close()


def test_verify_checkpoint_passes_on_a_grown_store_and_names_a_truncated_newest_batch(tmp_path, keys, capsys):
    db = tmp_path / "a.duckdb"
    _fill(db, 3)
    _checkpoint(db, keys, tmp_path / "cp")
    _fill(db, 1, start=4)
    rc, out, _ = run_cli(
        capsys, "audit", "verify", "--db", str(db), "--checkpoint", str(tmp_path / "cp"), "--public-key", str(keys[1])
    )
    assert rc == 0 and any("extends the checkpoint of 8 batches" in line for line in out)
    # An operator removes the checkpoint's newest batch and everything after it, log and frontier included:
    # the chain alone verifies (the newest batches of a chain can go unnoticed), the checkpoint does not.
    con = duckdb.connect(str(db))
    newest = LogView(con).leaves[7]
    delete_stored(con, "(producer_id = ? AND batch_no >= ?)", [newest.producer_id, newest.batch_no])
    other = LogView(con).leaves[6]
    delete_stored(con, "(producer_id = ? AND batch_no > ?)", [other.producer_id, other.batch_no])
    con.close()
    rc, out, _ = run_cli(capsys, "audit", "verify", "--db", str(db))
    assert rc == 0  # what the chain alone says
    rc, out, _ = run_cli(
        capsys, "audit", "verify", "--db", str(db), "--checkpoint", str(tmp_path / "cp"), "--public-key", str(keys[1])
    )
    assert rc == 1
    failed = [line for line in out if line.startswith("FAILED: checkpoint")]
    assert failed and "truncated" in failed[0] and f"batch {newest.producer_id}.{newest.batch_no}" in failed[0]


def test_verify_checkpoint_fails_on_a_rewritten_batch_and_the_chain_names_it(tmp_path, keys, capsys):
    db = tmp_path / "a.duckdb"
    _fill(db, 3)
    _checkpoint(db, keys, tmp_path / "cp")
    con = duckdb.connect(str(db))
    leaf = LogView(con).leaves[3]
    con.execute(
        "UPDATE batches SET digest = ? WHERE producer_id = ? AND batch_no = ?",
        [bytes(32), leaf.producer_id, leaf.batch_no],
    )
    con.close()
    rc, out, _ = run_cli(
        capsys, "audit", "verify", "--db", str(db), "--checkpoint", str(tmp_path / "cp"), "--public-key", str(keys[1])
    )
    assert rc == 1
    assert any(line.startswith("FAILED: checkpoint: forked") for line in out)
    assert any(f"batch {leaf.batch_no}" in line for line in out if "FAILED: first problem" in line)


def test_a_fork_with_the_same_origin_is_caught(tmp_path, keys):
    a, b = tmp_path / "a.duckdb", tmp_path / "b.duckdb"
    _fill(a, 2)
    shutil.copy(a, b)
    _fill(a, 1, start=3, tag="x")
    _fill(b, 1, start=3, tag="y")  # the same origin, a different third batch: two histories
    cp_a = _checkpoint(a, keys, tmp_path / "cpa").checkpoint
    con = connect_readonly(b)
    assert LogView(con).origin == cp_a.origin
    problems = verify_against(con, cp_a)
    con.close()
    assert problems and problems[0].startswith("forked")


def test_a_checkpoint_resigned_with_another_key_is_refused(tmp_path, keys, capsys):
    db = tmp_path / "a.duckdb"
    _fill(db, 1)
    generate_keypair(tmp_path / "evil.pem", tmp_path / "evil.pub")
    con = connect_readonly(db)
    cp = LogView(con).checkpoint()
    con.close()
    forged = sign_checkpoint(cp, Signer.from_file(tmp_path / "evil.pem"))
    (tmp_path / "cp").write_text(forged.text())
    assert not verify_log_signature(parse_note(forged.text()), SignatureChecker.from_file(keys[1]))
    rc, out, _ = run_cli(
        capsys, "audit", "verify", "--db", str(db), "--checkpoint", str(tmp_path / "cp"), "--public-key", str(keys[1])
    )
    assert rc == 1 and any("not the log's" in line for line in out)
    # a body edited under the log's genuine signature fails too
    good = sign_checkpoint(cp, Signer.from_file(keys[0])).text()
    edited = good.replace(f"\n{cp.size}\n", f"\n{cp.size + 1}\n", 1)
    assert not verify_log_signature(parse_note(edited), SignatureChecker.from_file(keys[1]))


@pytest.mark.parametrize(
    "text, field",
    [
        ("o\n01\nAAAA\n\n— o AAAAAAAA\n", "tree size"),
        ("o\n1\nAAAA\n\n— o AAAAAAAA\n", "root hash"),
        ("o\n1\n" + "A" * 43 + "=\n— o x\n", "blank line"),
    ],
)
def test_a_malformed_checkpoint_is_bad_input_naming_what(tmp_path, keys, capsys, text, field):
    db = tmp_path / "a.duckdb"
    _fill(db, 1)
    (tmp_path / "cp").write_text(text)
    rc, _, err = run_cli(
        capsys, "audit", "verify", "--db", str(db), "--checkpoint", str(tmp_path / "cp"), "--public-key", str(keys[1])
    )
    assert rc == 2 and field in err[0]


def test_prove_cli_consistency_and_request_inclusion_verify(tmp_path, keys, capsys):
    from kvtrail.audit.tlog import check_consistency_doc, check_inclusion_doc

    db = tmp_path / "a.duckdb"
    _fill(db, 2)
    old = _checkpoint(db, keys, tmp_path / "cp1").checkpoint
    _fill(db, 3, start=3)
    new = _checkpoint(db, keys, tmp_path / "cp2").checkpoint
    rc, out, _ = run_cli(
        capsys, "audit", "prove", "--db", str(db), "--from", str(tmp_path / "cp1"), "--to", str(tmp_path / "cp2")
    )
    doc = json.loads("\n".join(out))
    assert rc == 0 and (doc["old_size"], doc["new_size"]) == (old.size, new.size)
    assert check_consistency_doc(doc, old, new)
    assert not check_consistency_doc(doc, old, Checkpoint(new.origin, new.size, bytes(32)))
    rc, out, _ = run_cli(
        capsys, "audit", "prove", "--db", str(db), "--request", "r4", "--checkpoint", str(tmp_path / "cp2")
    )
    doc = json.loads("\n".join(out))
    assert rc == 0 and [leaf["batch_no"] for leaf in doc["leaves"]] == [4]
    assert check_inclusion_doc(doc, new) == []
    doc["leaves"][0]["leaf_index"] += 1
    assert check_inclusion_doc(doc, new)
    rc, _, err = run_cli(capsys, "audit", "prove", "--db", str(db), "--request", "nope")
    assert rc == 2 and "nope" in err[0]


def test_export_and_import_keep_the_log_so_old_checkpoints_still_verify(tmp_path, keys):
    from kvtrail.audit.export import export_parquet, import_parquet

    db = tmp_path / "a.duckdb"
    _fill(db, 3)
    cp = _checkpoint(db, keys, tmp_path / "cp").checkpoint
    export_parquet(db, tmp_path / "out")
    import_parquet(tmp_path / "out", tmp_path / "b.duckdb")
    con = connect_readonly(tmp_path / "b.duckdb")
    try:
        assert LogView(con).checkpoint() == cp
        assert verify_against(con, cp) == []
    finally:
        con.close()


def test_the_cached_frontier_and_the_batches_since_give_the_whole_tree(tmp_path):
    from kvtrail.audit.tlog import current_checkpoint

    db = tmp_path / "a.duckdb"
    _fill(db, 3)  # closed: the frontier is cached at 8 leaves
    store = AuditStore(db)
    try:
        store.append(_table([alloc(4, [4], rid="r4", prod=P), alloc(4, [5], rid="dr4", prod=D)]))
        cur = store.cursor()
        now = current_checkpoint(cur)  # the cache (8) extended by the commit since, without a checkpoint
        full = LogView(cur).checkpoint()
        cur.close()
        assert now == full and now.size == 10
        assert now.root == store.tree.frontier.root()
        assert now.extensions == (f"kvtrail newest-batch {LogView(store.cursor()).leaves[-1].producer_id}.4",)
    finally:
        store.close()
