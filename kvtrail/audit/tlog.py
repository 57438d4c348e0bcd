"""The store's transparency log: one RFC 9162 Merkle tree per store over its committed batches.

Leaf ``i`` is the ``i``-th committed batch's chain digest (``batches.digest``), in commit order: the
order of (``committed_ns``, ``producer_id``, ``batch_no``), which the writer keeps strictly increasing
from commit to commit (a group commit's batches share one time and follow in producer order). So the
leaves are the ``batches`` rows themselves and a commit adds no statement: it hashes its leaves into the
in-memory compact frontier, which ``meta``'s ``tlog_frontier`` caches at each store checkpoint (``meta``'s
``tlog_origin`` names the log). A store an older kvtrail wrote has the same tree, read the same way.
Pruning keeps ``batches`` rows, so the tree never loses a leaf. See docs/audit-log.md.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

import duckdb

from kvtrail.audit.merkle import Frontier, Tree, leaf_hash, verify_consistency, verify_inclusion
from kvtrail.audit.note import Checkpoint
from kvtrail.errors import KvtrailError

FRONTIER_KEY = "tlog_frontier"
ORIGIN_KEY = "tlog_origin"
# The leaves' order: commit order, as the writer keeps committed_ns (kvtrail.audit.store).
LEAF_ORDER = "committed_ns, producer_id, batch_no"
NEWEST_PREFIX = "kvtrail newest-batch "  # the checkpoint's extension line naming its newest leaf's batch


@dataclass(frozen=True)
class Leaf:
    index: int
    producer_id: int
    batch_no: int
    digest: bytes


def origin(con: duckdb.DuckDBPyConnection) -> str:
    """The log's origin line: ``meta``'s ``tlog_origin``, fixed from the store's creation time when the
    store first had a log (an import into a new store adopts the exported one)."""
    row = con.execute("SELECT value FROM meta WHERE key = ?", [ORIGIN_KEY]).fetchone()
    if row:
        return str(row[0])
    row = con.execute("SELECT value FROM meta WHERE key = 'created_ns'").fetchone()
    return f"kvtrail.store/{row[0] if row else 'unknown'}"


def read_leaves(con: duckdb.DuckDBPyConnection) -> list[Leaf]:
    """The tree's leaves in order."""
    con.complete()
    rows = con.execute(f"SELECT producer_id, batch_no, digest FROM batches ORDER BY {LEAF_ORDER}").fetchall()
    return [Leaf(i, int(p), int(b), bytes(d)) for i, (p, b, d) in enumerate(rows)]


def _count(con: duckdb.DuckDBPyConnection) -> int:
    row = con.execute("SELECT count(*) FROM batches").fetchone()
    return int(row[0]) if row else 0


def load_frontier(con: duckdb.DuckDBPyConnection) -> Frontier:
    """The tree's frontier now: the cached one extended by the batches committed since (recomputed
    whole when the cache does not fit)."""
    row = con.execute("SELECT value FROM meta WHERE key = ?", [FRONTIER_KEY]).fetchone()
    try:
        frontier = Frontier.decode(row[0]) if row else Frontier()
    except ValueError:
        frontier = Frontier()
    total = _count(con)
    if frontier.size > total:
        frontier = Frontier()
    if frontier.size < total:
        rows = con.execute(f"SELECT digest FROM batches ORDER BY {LEAF_ORDER} OFFSET ?", [frontier.size]).fetchall()
        for (digest,) in rows:
            frontier.append(bytes(digest))
    return frontier


def save_frontier(con: duckdb.DuckDBPyConnection, frontier: Frontier) -> None:
    con.execute("DELETE FROM meta WHERE key = ?", [FRONTIER_KEY])
    con.execute("INSERT INTO meta VALUES (?, ?)", [FRONTIER_KEY, frontier.encode()])


class TreeWriter:
    """The writer's side: the frontier, advanced by each commit (hashing only; no statement)."""

    def __init__(self, con: duckdb.DuckDBPyConnection):
        """Name the log and load its frontier; runs inside the writable open's transaction."""
        if con.execute("SELECT count(*) FROM meta WHERE key = ?", [ORIGIN_KEY]).fetchone() == (0,):
            con.execute("INSERT INTO meta VALUES (?, ?)", [ORIGIN_KEY, origin(con)])
        self.frontier = load_frontier(con)
        self.saved = -1

    def stage(self, batches: list[tuple[int, int, bytes]]) -> Frontier:
        """The frontier after appending ``batches`` (producer, batch_no, digest) of one commit."""
        f = self.frontier.copy()
        for _pid, _batch_no, digest in sorted(batches):
            f.append(digest)
        return f

    def save(self, con: duckdb.DuckDBPyConnection) -> None:
        """Cache the frontier in ``meta`` (at a store checkpoint), so an open need not rehash the tree."""
        if self.frontier.size != self.saved:
            save_frontier(con, self.frontier)
            self.saved = self.frontier.size


def current_checkpoint(con: duckdb.DuckDBPyConnection) -> Checkpoint:
    """The checkpoint of the tree now, from the cached frontier and the batches since (one snapshot)."""
    con.complete()
    con.begin()
    try:
        frontier = load_frontier(con)
        last = con.execute(
            "SELECT producer_id, batch_no FROM batches "
            "ORDER BY committed_ns DESC, producer_id DESC, batch_no DESC LIMIT 1"
        ).fetchone()
        ext = (f"{NEWEST_PREFIX}{last[0]}.{last[1]}",) if last else ()
        return Checkpoint(origin(con), frontier.size, frontier.root(), ext)
    finally:
        con.commit()


class LogView:
    """The log as a reader sees it: leaves, roots, proofs; a checkpoint checked against it."""

    def __init__(self, con: duckdb.DuckDBPyConnection):
        self.origin = origin(con)
        self.leaves = read_leaves(con)
        self.tree = Tree([leaf_hash(leaf.digest) for leaf in self.leaves])

    @property
    def size(self) -> int:
        return len(self.leaves)

    def checkpoint(self, size: int | None = None) -> Checkpoint:
        n = self.size if size is None else size
        ext: tuple[str, ...] = ()
        if n:
            last = self.leaves[n - 1]
            ext = (f"{NEWEST_PREFIX}{last.producer_id}.{last.batch_no}",)
        return Checkpoint(self.origin, n, self.tree.root(n), ext)

    def consistency(self, old: Checkpoint, new: Checkpoint | None = None) -> dict:
        """The consistency proof document from ``old`` to ``new`` (the store's tree now by default)."""
        new = new or self.checkpoint()
        for cp, what in ((old, "--from"), (new, "--to")):
            if cp.origin != self.origin:
                raise KvtrailError(f"{what}: checkpoint of log {cp.origin!r}, this store's log is {self.origin!r}")
            if cp.size > self.size:
                raise KvtrailError(f"{what}: checkpoint of {cp.size} leaves, the store's log holds {self.size}")
        if old.size > new.size:
            raise KvtrailError(f"--from: tree size {old.size} is larger than --to's {new.size}")
        return {
            "type": "consistency",
            "origin": self.origin,
            "old_size": old.size,
            "old_root": b64(old.root),
            "new_size": new.size,
            "new_root": b64(new.root),
            "proof": [b64(h) for h in self.tree.consistency_proof(old.size, new.size)],
        }

    def inclusion(self, batches: list[tuple[int, int]], size: int | None = None) -> dict:
        """Inclusion proofs of the leaves of ``batches`` (producer, batch_no) in the tree of ``size`` leaves."""
        n = self.size if size is None else size
        where = {(leaf.producer_id, leaf.batch_no): leaf for leaf in self.leaves[:n]}
        out = []
        for key in sorted(set(batches)):
            leaf = where.get(key)
            if leaf is None:
                raise KvtrailError(f"batch {key[0]}.{key[1]} is not among the log's first {n} leaves")
            out.append(
                {
                    "leaf_index": leaf.index,
                    "producer_id": leaf.producer_id,
                    "batch_no": leaf.batch_no,
                    "batch_digest": leaf.digest.hex(),
                    "proof": [b64(h) for h in self.tree.inclusion_proof(leaf.index, n)],
                }
            )
        return {
            "type": "inclusion",
            "origin": self.origin,
            "tree_size": n,
            "root": b64(self.tree.root(n)),
            "leaves": out,
        }


def b64(h: bytes) -> str:
    return base64.b64encode(h).decode()


def unb64(text: object, what: str) -> bytes:
    try:
        raw = base64.b64decode(str(text), validate=True)
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise KvtrailError(f"{what}: not base64 of a 32-byte hash")
    return raw


def check_inclusion_doc(doc: dict, cp: Checkpoint) -> list[str]:
    """Problems of an inclusion proof document against a checkpoint (none: every leaf proven)."""
    problems = []
    if doc.get("origin") != cp.origin or doc.get("tree_size") != cp.size:
        return [f"proofs are for log {doc.get('origin')!r} size {doc.get('tree_size')}, not the checkpoint's"]
    for i, leaf in enumerate(doc.get("leaves", [])):
        try:
            digest = bytes.fromhex(leaf["batch_digest"])
            path = [unb64(h, f"leaves[{i}].proof") for h in leaf["proof"]]
            ok = verify_inclusion(leaf_hash(digest), int(leaf["leaf_index"]), cp.size, path, cp.root)
        except (KeyError, ValueError, TypeError, KvtrailError):
            ok = False
        if not ok:
            problems.append(
                f"batch {leaf.get('producer_id')}.{leaf.get('batch_no')}: its inclusion proof does not "
                f"verify against the checkpoint's root"
            )
    return problems


def check_consistency_doc(doc: dict, old: Checkpoint, new: Checkpoint) -> bool:
    try:
        path = [unb64(h, "proof") for h in doc["proof"]]
    except (KeyError, TypeError, KvtrailError):
        return False
    return verify_consistency(old.size, new.size, old.root, new.root, path)


def verify_against(con: duckdb.DuckDBPyConnection, cp: Checkpoint) -> list[str]:
    """What the store no longer holds of what ``cp`` committed to: each problem names the leaf, and the
    batch where the store or the checkpoint can name it; empty when the store's tree extends ``cp``."""
    view = LogView(con)
    if cp.origin != view.origin:
        return [f"the checkpoint is of log {cp.origin!r}, this store's log is {view.origin!r}"]
    problems = []
    newest = next((e[len(NEWEST_PREFIX) :] for e in cp.extensions if e.startswith(NEWEST_PREFIX)), None)
    if view.size < cp.size:
        named = f" (the checkpoint's newest, batch {newest})" if newest else ""
        problems.append(
            f"truncated: the checkpoint commits to {cp.size} batches, the store's log holds {view.size}: "
            f"leaf {view.size}..{cp.size - 1}{named} missing"
        )
    if view.size >= cp.size and view.tree.root(cp.size) != cp.root:
        problems.append(
            f"forked: the store's first {cp.size} leaves hash to {b64(view.tree.root(cp.size))}, not the "
            f"checkpoint's root {b64(cp.root)}: a batch among them was rewritten, removed or reordered"
        )
    elif view.size >= cp.size and newest and cp.size:
        last = view.leaves[cp.size - 1]
        if newest != f"{last.producer_id}.{last.batch_no}":
            problems.append(
                f"leaf {cp.size - 1}: the checkpoint names batch {newest}, the store holds "
                f"{last.producer_id}.{last.batch_no}"
            )
    return problems
