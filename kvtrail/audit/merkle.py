"""RFC 9162 §2.1 Merkle trees: hashes, the compact frontier, inclusion and consistency proofs.

Leaf hash ``H(0x00 ‖ data)``, interior node ``H(0x01 ‖ left ‖ right)``, SHA-256; the empty tree's root
is ``H("")``. The distinct prefixes keep a leaf from passing for a node (the second preimage a plain
hash tree allows). Proof generation works on a :class:`Tree` of leaf hashes; the verifiers take only
hashes and sizes, so a party holding a checkpoint checks a proof with nothing else.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

HASH_SIZE = 32
EMPTY_ROOT = hashlib.sha256(b"").digest()


def leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two smaller than ``n`` (n >= 2): where RFC 9162 splits a tree of n leaves."""
    return 1 << ((n - 1).bit_length() - 1)


class Frontier:
    """The compact range of a tree: the roots of its perfect subtrees, largest (leftmost) first.

    Enough to append a leaf and compute the root in O(log n) without the leaves; what the store keeps
    between commits.
    """

    def __init__(self, size: int = 0, hashes: Sequence[bytes] = ()):
        if len(hashes) != bin(size).count("1"):
            raise ValueError(
                f"frontier: a tree of {size} leaves has {bin(size).count('1')} subtrees, got {len(hashes)}"
            )
        self.size = size
        self.hashes = list(hashes)

    def copy(self) -> Frontier:
        return Frontier(self.size, self.hashes)

    def append(self, data: bytes) -> None:
        h = leaf_hash(data)
        # Each trailing 1 bit of the old size is a subtree of that height the new leaf completes.
        n = self.size
        while n & 1:
            h = node_hash(self.hashes.pop(), h)
            n >>= 1
        self.hashes.append(h)
        self.size += 1

    def root(self) -> bytes:
        if not self.hashes:
            return EMPTY_ROOT
        r = self.hashes[-1]
        for h in reversed(self.hashes[:-1]):
            r = node_hash(h, r)
        return r

    def encode(self) -> str:
        return f"{self.size}:" + ",".join(h.hex() for h in self.hashes)

    @classmethod
    def decode(cls, text: str) -> Frontier:
        size, _, hexes = text.partition(":")
        return cls(int(size), [bytes.fromhex(h) for h in hexes.split(",") if h])


class Tree:
    """All leaf hashes of a tree, with its perfect subtrees' roots level by level (built once, O(n)),
    so each subtree root a proof needs costs O(log n)."""

    def __init__(self, leaf_hashes: Sequence[bytes]):
        self.levels: list[list[bytes]] = [list(leaf_hashes)]
        while len(self.levels[-1]) > 1:
            lv = self.levels[-1]
            self.levels.append([node_hash(lv[i], lv[i + 1]) for i in range(0, len(lv) - 1, 2)])

    @classmethod
    def of(cls, leaves: Sequence[bytes]) -> Tree:
        return cls([leaf_hash(d) for d in leaves])

    @property
    def size(self) -> int:
        return len(self.levels[0])

    def subtree(self, start: int, end: int) -> bytes:
        """MTH of leaves[start:end] as RFC 9162 defines it (start aligned as the recursion leaves it)."""
        n = end - start
        if n == 0:
            return EMPTY_ROOT
        if n & (n - 1) == 0 and start % n == 0:  # a perfect, aligned subtree: stored
            return self.levels[n.bit_length() - 1][start // n]
        k = _split(n)
        return node_hash(self.subtree(start, start + k), self.subtree(start + k, end))

    def root(self, size: int | None = None) -> bytes:
        return self.subtree(0, self.size if size is None else self._check_size(size))

    def _check_size(self, size: int) -> int:
        if not 0 <= size <= self.size:
            raise ValueError(f"tree size {size} outside 0..{self.size}")
        return size

    def inclusion_proof(self, index: int, size: int) -> list[bytes]:
        """PATH(index, D[0:size]) of RFC 9162 §2.1.3.1."""
        self._check_size(size)
        if not 0 <= index < size:
            raise ValueError(f"leaf index {index} outside a tree of {size} leaves")
        path: list[bytes] = []
        start, end = 0, size
        while end - start > 1:
            k = _split(end - start)
            if index < start + k:
                path.append(self.subtree(start + k, end))
                end = start + k
            else:
                path.append(self.subtree(start, start + k))
                start += k
        return path[::-1]

    def consistency_proof(self, old: int, new: int) -> list[bytes]:
        """PROOF(old, D[0:new]) of RFC 9162 §2.1.4.1 (empty when old is 0 or equals new)."""
        self._check_size(new)
        if not 0 <= old <= new:
            raise ValueError(f"old size {old} outside 0..{new}")
        if old == 0 or old == new:
            return []
        path: list[bytes] = []
        start, end, m, whole = 0, new, old, True
        while m != end - start:
            k = _split(end - start)
            if m <= k:
                path.append(self.subtree(start + k, end))
                end = start + k
            else:
                path.append(self.subtree(start, start + k))
                start, m, whole = start + k, m - k, False
        if not whole:
            path.append(self.subtree(start, end))
        return path[::-1]


def root_of(leaves: Sequence[bytes]) -> bytes:
    f = Frontier()
    for d in leaves:
        f.append(d)
    return f.root()


def _hashes(path: Sequence[bytes]) -> bool:
    return all(isinstance(p, bytes) and len(p) == HASH_SIZE for p in path)


def verify_inclusion(leaf: bytes, index: int, size: int, path: Sequence[bytes], root: bytes) -> bool:
    """RFC 9162 §2.1.3.2: whether ``path`` proves the leaf hash ``leaf`` at ``index`` of the tree of
    ``size`` leaves whose root is ``root``."""
    if not (0 <= index < size) or not _hashes(path) or len(leaf) != HASH_SIZE:
        return False
    fn, sn, r = index, size - 1, leaf
    for p in path:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return sn == 0 and r == root


def verify_consistency(old: int, new: int, old_root: bytes, new_root: bytes, path: Sequence[bytes]) -> bool:
    """RFC 9162 §2.1.4.2: whether ``path`` proves the tree (old, old_root) a prefix of (new, new_root).
    From the empty tree (old 0) every tree is an extension; the proof must then be empty."""
    if not (0 <= old <= new) or not _hashes(path):
        return False
    if old == 0:
        return not path and old_root == EMPTY_ROOT
    if old == new:
        return not path and old_root == new_root
    if not path:
        return False
    proof = list(path)
    if old & (old - 1) == 0:  # old is a power of two: its root is a node of the new tree
        proof.insert(0, old_root)
    fn, sn = old - 1, new - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = proof[0]
    for c in proof[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    return fr == old_root and sr == new_root and sn == 0
