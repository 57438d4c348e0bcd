"""RFC 9162 trees against a malicious prover, and against an independent implementation (pymerkle)."""

from __future__ import annotations

import random

import pytest

from kvtrail.audit.merkle import (
    EMPTY_ROOT,
    Frontier,
    Tree,
    leaf_hash,
    node_hash,
    root_of,
    verify_consistency,
    verify_inclusion,
)

pymerkle = pytest.importorskip("pymerkle")


def _tree(n: int, seed: int = 0) -> tuple[list[bytes], Tree]:
    rng = random.Random(seed)
    data = [rng.randbytes(32) for _ in range(n)]
    return data, Tree.of(data)


def test_known_answer_a_tree_a_reader_can_check_by_hand():
    a, b, c = leaf_hash(b"a"), leaf_hash(b"b"), leaf_hash(b"c")
    assert root_of([b"a", b"b", b"c"]) == node_hash(node_hash(a, b), c)
    assert root_of([]) == EMPTY_ROOT and root_of([b"a"]) == a
    assert Tree.of([b"a", b"b", b"c"]).inclusion_proof(2, 3) == [node_hash(a, b)]


@pytest.mark.parametrize("seed", range(3))
def test_pymerkle_agrees_on_roots_and_proofs_of_random_trees(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 70)
    data, tree = _tree(n, seed)
    other = pymerkle.InmemoryTree(algorithm="sha256")  # security mode: RFC 9162's 0x00 / 0x01 prefixes
    frontier = Frontier()
    for d in data:
        other.append_entry(d)
        frontier.append(d)
        assert frontier.root() == other.get_root(frontier.size)
    for size in range(1, n + 1):
        assert tree.root(size) == other.get_root(size)
        for index in rng.sample(range(size), min(size, 4)):
            ours = tree.inclusion_proof(index, size)
            theirs = other.prove_inclusion(index + 1, size)  # pymerkle counts leaves from 1
            # pymerkle's path is the leaf hash followed by RFC 9162's audit path, bottom up
            assert [bytes.fromhex(h) for h in theirs.serialize()["path"]][1:] == ours
            pymerkle.verify_inclusion(leaf_hash(data[index]), tree.root(size), theirs)
            assert verify_inclusion(leaf_hash(data[index]), index, size, ours, tree.root(size))
        for old in rng.sample(range(1, size + 1), min(size, 4)):
            ours = tree.consistency_proof(old, size)
            assert verify_consistency(old, size, tree.root(old), tree.root(size), ours)
            theirs = other.prove_consistency(old, size)
            # the independent verifier (it raises on failure) accepts our roots of both sizes
            pymerkle.verify_consistency(tree.root(old), tree.root(size), theirs)


# ---- the malicious prover ----------------------------------------------------------------------


def test_inclusion_forgeries_are_refused():
    data, tree = _tree(13)
    root, i = tree.root(), 5
    leaf = leaf_hash(data[i])
    path = tree.inclusion_proof(i, 13)
    assert verify_inclusion(leaf, i, 13, path, root)
    assert not verify_inclusion(leaf, i, 13, path[:-1], root)  # path too short
    assert not verify_inclusion(leaf, i, 13, [*path, path[0]], root)  # path too long
    for wrong in (4, 6, 12, 13, -1):  # wrong index (and out of range)
        assert not verify_inclusion(leaf, wrong, 13, path, root)
    for k in range(len(path) - 1):  # swapped siblings
        swapped = list(path)
        swapped[k], swapped[k + 1] = swapped[k + 1], swapped[k]
        if swapped != path:
            assert not verify_inclusion(leaf, i, 13, swapped, root)
    assert not verify_inclusion(leaf, i, 12, tree.inclusion_proof(i, 12), root)  # proof for another size
    # A size of another shape (the same shape for sizes 9..16 here: the checkpoint binds size and root together)
    for size in (6, 8, 17, 32):
        assert not verify_inclusion(leaf, i, size, path, root)
    assert not verify_inclusion(leaf_hash(data[i] + b"x"), i, 13, path, root)  # another leaf
    assert not verify_inclusion(leaf, i, 13, [p[:31] for p in path], root)  # not hashes


def test_leaf_node_confusion_is_no_second_preimage():
    # An interior node's children, offered as a leaf's data, hash differently: the 0x00 / 0x01 prefixes.
    data, tree = _tree(8)
    left, right = tree.subtree(0, 2), tree.subtree(2, 4)
    fake = left + right  # 64 bytes whose plain hash would be the node over leaves 0..3
    path = tree.inclusion_proof(0, 8)[2:]  # the path of node (0..3) within the tree
    assert node_hash(left, right) == tree.subtree(0, 4)
    assert not verify_inclusion(leaf_hash(fake), 0, 2, path, tree.root())
    assert not verify_inclusion(leaf_hash(fake), 0, 8, tree.inclusion_proof(0, 8), tree.root())
    assert leaf_hash(fake) != tree.subtree(0, 4)


def test_consistency_forgeries_are_refused():
    data, tree = _tree(21)
    r7, r21 = tree.root(7), tree.root(21)
    proof = tree.consistency_proof(7, 21)
    assert verify_consistency(7, 21, r7, r21, proof)
    assert not verify_consistency(7, 21, r7, r21, proof[:-1])
    assert not verify_consistency(7, 21, r7, r21, [*proof, proof[0]])
    assert not verify_consistency(6, 21, tree.root(6), r21, proof)  # proof for another size
    assert not verify_consistency(7, 20, r7, tree.root(20), proof)
    assert not verify_consistency(7, 21, r7, r21, proof[::-1])
    assert not verify_consistency(21, 7, r21, r7, proof)  # a rollback
    assert not verify_consistency(7, 21, r7, r21, [])
    assert not verify_consistency(7, 7, r7, tree.root(8), [])
    # a fork: the same old tree, a different new history
    forked = Tree.of(data[:7] + [b"other"] * 14)
    assert forked.root(7) == r7
    assert not verify_consistency(7, 21, r7, forked.root(21), proof)
    assert verify_consistency(7, 21, r7, forked.root(21), forked.consistency_proof(7, 21))
    # a rewrite of an old leaf: the new tree is not consistent with the old root
    rewritten = Tree.of([b"x", *data[1:]])
    assert not verify_consistency(7, 21, r7, rewritten.root(21), rewritten.consistency_proof(7, 21))
    assert verify_consistency(0, 21, EMPTY_ROOT, r21, []) and not verify_consistency(0, 21, EMPTY_ROOT, r21, proof)


def test_frontier_survives_encoding_and_refuses_a_wrong_shape():
    f = Frontier()
    for i in range(11):
        f.append(bytes([i]))
    assert Frontier.decode(f.encode()).root() == f.root() == root_of([bytes([i]) for i in range(11)])
    with pytest.raises(ValueError, match="subtrees"):
        Frontier(11, f.hashes[:-1])


def test_the_worked_example_in_the_docs_is_what_the_code_computes():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "audit-log.md").read_text()
    tree = Tree.of([b"a", b"b", b"c"])
    leaves = [leaf_hash(x) for x in (b"a", b"b", b"c")]
    for h in (*leaves, tree.subtree(0, 2), tree.root()):
        assert f"`{h.hex()}`" in doc
    import base64

    assert base64.b64encode(tree.root()).decode() in doc
    assert tree.inclusion_proof(2, 3) == [tree.subtree(0, 2)] and tree.inclusion_proof(0, 3) == leaves[1:]
    assert tree.consistency_proof(2, 3) == [leaves[2]]
