"""Retention: legal holds and ``kvtrail audit prune``.

Pruning works on whole batches so every batch left behind still verifies against its digest, and
the removed batches keep their chain header (digests, seq range, counts) marked ``pruned_by``. Each
prune is recorded in ``prunes`` (and the batches it removed in ``prune_batches``), and those records
form a chain of their own. A batch holding any event under an active legal hold is never pruned.
"""

from __future__ import annotations

import hashlib
import struct
import time
from dataclasses import dataclass

from kvtrail.audit import chain
from kvtrail.audit.layout import delete_batches
from kvtrail.audit.store import AuditStore, fetch_row
from kvtrail.errors import StoreError


@dataclass(frozen=True)
class Hold:
    hold_id: int
    created_ns: int
    from_ns: int
    to_ns: int
    tenant_id: str | None
    node: str | None
    reason: str
    released_ns: int | None


@dataclass(frozen=True)
class PruneResult:
    prune_id: int | None
    num_batches: int
    num_events: int
    num_held_batches: int
    dry_run: bool


def prune_digest(
    prev: bytes,
    prune_id: int,
    wall_ns: int,
    before_ns: int,
    num_batches: int,
    num_events: int,
    num_held: int,
    note: str | None,
    batches: list[tuple[int, int]],
) -> bytes:
    h = hashlib.sha256(prev)
    h.update(struct.pack("<6q", prune_id, wall_ns, before_ns, num_batches, num_events, num_held))
    h.update((note or "").encode() + b"\0")
    for pid, batch_no in batches:
        h.update(struct.pack("<qq", pid, batch_no))
    return h.digest()


def add_hold(
    store: AuditStore, from_ns: int, to_ns: int, reason: str, *, tenant_id: str | None = None, node: str | None = None
) -> int:
    """Place a legal hold on a time window, optionally limited to one tenant or node. Returns its id."""
    if from_ns > to_ns:
        raise StoreError("hold: --from is after --to")
    if not reason.strip():
        raise StoreError("hold: --reason must not be empty")
    con = store.con
    hold_id = fetch_row(con, "SELECT coalesce(max(hold_id), 0) + 1 FROM legal_holds")[0]
    con.execute(
        "INSERT INTO legal_holds VALUES (?, ?, ?, ?, ?, ?, ?, NULL)",
        [hold_id, time.time_ns(), from_ns, to_ns, tenant_id, node, reason],
    )
    return hold_id


def release_hold(store: AuditStore, hold_id: int) -> None:
    row = store.con.execute("SELECT released_ns FROM legal_holds WHERE hold_id = ?", [hold_id]).fetchone()
    if row is None:
        raise StoreError(f"hold: no hold with id {hold_id}")
    if row[0] is not None:
        raise StoreError(f"hold: hold {hold_id} was already released")
    store.con.execute("UPDATE legal_holds SET released_ns = ? WHERE hold_id = ?", [time.time_ns(), hold_id])


def list_holds(store: AuditStore) -> list[Hold]:
    return [Hold(*r) for r in store.con.execute("SELECT * FROM legal_holds ORDER BY hold_id").fetchall()]


# Batches eligible for pruning, and which of them an active hold protects. A tenant hold protects
# every batch holding an event of any request of that tenant in the window (page events often carry
# only the request id); a node or window-only hold protects batches overlapping the window.
_CANDIDATES = """
CREATE OR REPLACE TEMP TABLE _prune_cand AS
SELECT b.producer_id, b.batch_no, b.num_events, b.min_wall_ns, b.max_wall_ns, p.node
FROM batches b JOIN producers p USING (producer_id)
WHERE b.pruned_by IS NULL AND b.max_wall_ns < ?
"""
_HELD = """
CREATE OR REPLACE TEMP TABLE _prune_held AS
SELECT DISTINCT c.producer_id, c.batch_no FROM _prune_cand c JOIN legal_holds h
  ON h.released_ns IS NULL AND h.tenant_id IS NULL AND c.max_wall_ns >= h.from_ns AND c.min_wall_ns <= h.to_ns
  AND (h.node IS NULL OR h.node = c.node)
UNION
SELECT DISTINCT c.producer_id, c.batch_no FROM _prune_cand c
  JOIN events e ON e.producer_id = c.producer_id AND e.batch_no = c.batch_no
  JOIN legal_holds h ON h.released_ns IS NULL AND h.tenant_id IS NOT NULL
   AND e.wall_ns BETWEEN h.from_ns AND h.to_ns AND (h.node IS NULL OR h.node = c.node)
  WHERE e.request_id IN (SELECT request_id FROM events WHERE tenant_id = h.tenant_id)
"""


def prune(store: AuditStore, before_ns: int, *, note: str | None = None, dry_run: bool = False) -> PruneResult:
    """Remove batches whose events all precede ``before_ns``, except those under a legal hold."""
    con = store.con
    con.begin()
    try:
        con.execute(_CANDIDATES, [before_ns])
        con.execute(_HELD)
        held = fetch_row(con, "SELECT count(*) FROM _prune_held")[0]
        con.execute(
            "CREATE OR REPLACE TEMP TABLE _pruned AS SELECT producer_id, batch_no, num_events FROM _prune_cand "
            "ANTI JOIN _prune_held USING (producer_id, batch_no)"
        )
        nb, ne = fetch_row(con, "SELECT count(*), coalesce(sum(num_events), 0) FROM _pruned")
        if dry_run or nb == 0:
            con.rollback()
            return PruneResult(None, nb, int(ne), held, dry_run)
        listed = con.execute("SELECT producer_id, batch_no FROM _pruned ORDER BY producer_id, batch_no").fetchall()
        last = con.execute("SELECT prune_id, digest FROM prunes ORDER BY prune_id DESC LIMIT 1").fetchone()
        prune_id, prev = (last[0] + 1, bytes(last[1])) if last else (1, chain.GENESIS)
        now = time.time_ns()
        digest = prune_digest(prev, prune_id, now, before_ns, nb, int(ne), held, note, listed)
        con.execute(
            "INSERT INTO prunes VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [prune_id, now, before_ns, nb, int(ne), held, note, prev, digest],
        )
        con.execute("INSERT INTO prune_batches SELECT ?, producer_id, batch_no FROM _pruned", [prune_id])
        delete_batches(con, "_pruned")
        con.execute(
            "DELETE FROM page_runs USING _pruned p WHERE page_runs.producer_id = p.producer_id "
            "AND page_runs.batch_no = p.batch_no"
        )
        con.execute(
            "UPDATE batches SET pruned_by = ? FROM _pruned p WHERE batches.producer_id = p.producer_id "
            "AND batches.batch_no = p.batch_no",
            [prune_id],
        )
        con.commit()
    except BaseException:
        con.rollback()
        raise
    store.reset_requests()  # the prune deleted the identities no event names any more
    return PruneResult(prune_id, nb, int(ne), held, False)
