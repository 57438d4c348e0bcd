"""The model's properties as monitors over a recorded history (``kvtrail model validate``).

Events are fed in the judge's order (wall time, then cluster, node, instance and each producer's seq).
Each node's pool is its own, started afresh by a ``node_config`` of a new producer instance (a
restart); page events before a node's first ``node_config`` are not judged. A violation names its
property, the first event that shows it (``producer:seq``, node, request) and what was seen. Where the
record cannot show what a property needs, the monitors say so as coverage ("cannot tell"), never as a
pass.

How each property reads a history:
- ``no_foreign_read``: a ``kv_read`` by R of a page whose last write was not R's, unless R holds it as a
  prefix hit whose block hash is the one its writer stored, written by R's own tenant (namespace); a page
  R does not hold is not R's to read either. A page given to R for decode growth counts as R's. A page an
  ``unverified`` receipt may have written has an unknown writer: cannot tell.
- ``aborted_never_sent``: a ``transfer_sent`` for R on a node that already recorded R rejected or aborted.
- ``no_free_before_drain``: R's write lands (``kv_written`` from ``transfer_in``) on a page R freed: the
  free came before the drain; the first offending event is that free.
- ``transferred_equals_reserved``: decode reads for R after a receipt (or sends) for R whose tokens differ
  from what decode reserved; a read with a reservation and no receipt: cannot tell.
- ``pages_conserved``: a page allocated (not as a prefix hit) while another request holds it, or listed
  twice in one allocation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from kvtrail.model.properties import PROPERTIES

_COLUMNS = (
    "kind",
    "cluster",
    "node",
    "instance",
    "seq",
    "wall_ns",
    "request_id",
    "tenant_id",
    "pages",
    "purpose",
    "source",
    "num_tokens",
    "status",
    "block_hashes",
)


@dataclass
class Violation:
    property: str
    producer: str
    seq: int
    node: str
    request_id: str | None
    detail: str
    wall_ns: int

    def as_dict(self) -> dict:
        return {
            "property": self.property,
            "first_event": {
                "producer": self.producer,
                "seq": self.seq,
                "node": self.node,
                "request_id": self.request_id,
            },
            "detail": self.detail,
        }


_FREED_KEPT = 4  # per page, the latest requests that freed it (a late write of an earlier one goes unseen)


@dataclass
class _Pool:
    owners: dict[int, list] = field(default_factory=dict)  # page -> requests holding it exclusively
    hits: dict[int, dict] = field(default_factory=dict)  # page -> {request: block hash} (prefix-cache hits)
    writer: dict = field(default_factory=dict)  # page -> (request, tenant, block hash stored) ; None: unknown
    freed_by: dict[int, dict] = field(default_factory=dict)  # page -> {request: the event that freed it}

    def holds(self, page: int, rid) -> bool:
        return rid in self.owners.get(page, ()) or rid in self.hits.get(page, ())


class Monitors:
    """The five monitors over one history; ``from_ns``: violations before it are not reported (the
    history before it is still replayed, so the pools' state at ``from_ns`` is right)."""

    def __init__(self, from_ns: int | None = None):
        self.from_ns = from_ns
        self.pools: dict[tuple, _Pool] = {}
        self.instance_of: dict[tuple, str] = {}
        self.stopped: dict[tuple, dict] = {}  # (node, request) -> the abort event
        self.reserved: dict[tuple, int] = {}  # (node, request) -> tokens decode reserved
        self.received: dict[tuple, tuple[int, dict]] = {}  # (node, request) -> (tokens, event)
        self.sent: dict[str, int] = {}  # request -> tokens prefill sent
        self.tenant: dict[str, str] = {}
        self.violations: list[Violation] = []
        self.reported: set = set()
        self.cannot_tell: dict[tuple[str, str], list] = {}
        self.events = 0

    # ---- feeding ---------------------------------------------------------------------------------

    def feed(self, table: pa.Table, order: list[int] | None = None) -> None:
        """Judge one table of events, in ``order`` (row numbers; default: as they come)."""
        cols = {c: table.column(c).to_pylist() for c in _COLUMNS}
        kinds = cols["kind"]
        for n in range(table.num_rows) if order is None else order:
            handler = getattr(self, "on_" + kinds[n], None)
            self.events += 1
            if handler is not None:
                handler({c: cols[c][n] for c in _COLUMNS})

    def _pool(self, e: dict) -> _Pool | None:
        return self.pools.get((e["cluster"], e["node"]))

    def _report(self, prop: str, e: dict, detail: str, key=None) -> None:
        if self.from_ns is not None and e["wall_ns"] < self.from_ns:
            return
        key = (prop, key if key is not None else (e["request_id"], e["node"]))
        if key in self.reported:
            return
        self.reported.add(key)
        producer = f"{e['cluster']}/{e['node']}/{e['instance']}"
        self.violations.append(Violation(prop, producer, e["seq"], e["node"], e["request_id"], detail, e["wall_ns"]))

    def _unknown(self, prop: str, why: str, e: dict) -> None:
        self.cannot_tell.setdefault((prop, why), []).append(e)

    # ---- handlers --------------------------------------------------------------------------------

    def on_node_config(self, e: dict) -> None:
        key = (e["cluster"], e["node"])
        if self.instance_of.get(key) != e["instance"]:
            self.instance_of[key] = e["instance"]
            self.pools[key] = _Pool()  # a new producer instance: a fresh pool

    def on_request_received(self, e: dict) -> None:
        if e["tenant_id"] is not None:
            self.tenant.setdefault(e["request_id"], e["tenant_id"])

    def on_request_aborted(self, e: dict) -> None:
        self.stopped.setdefault((e["cluster"], e["node"], e["request_id"]), e)

    def on_pages_allocated(self, e: dict) -> None:
        pool = self._pool(e)
        if pool is None:
            return
        rid, pages = e["request_id"], e["pages"] or []
        if e["tenant_id"] is not None:
            self.tenant.setdefault(rid, e["tenant_id"])
        if e["purpose"] == "prefix_hit":
            for p, h in zip(pages, e["block_hashes"] or [None] * len(pages)):
                pool.hits.setdefault(p, {})[rid] = h
            return
        if len(set(pages)) != len(pages):
            self._report("pages_conserved", e, f"one allocation lists a page twice: {pages}")
        owners = pool.owners
        for p in pages:
            held = owners.get(p)
            if held is None:
                owners[p] = [rid]
            else:
                others = [r for r in held if r != rid]
                if others:
                    self._report("pages_conserved", e, f"page {p} allocated to {rid} while {others[0]} holds it")
                if rid not in held:
                    held.append(rid)
            if e["purpose"] == "decode_growth":
                pool.writer[p] = (rid, self.tenant.get(rid), None)  # the step that reads it fills it

    def on_pages_freed(self, e: dict) -> None:
        pool = self._pool(e)
        if pool is None:
            return
        rid = e["request_id"]
        owners, hits = pool.owners, pool.hits
        for p in e["pages"] or []:
            if rid is None:  # a radix eviction releases every holder
                owners.pop(p, None)
                hits.pop(p, None)
                continue
            held = owners.get(p)
            if held is not None and rid in held:
                held.remove(rid)
                if not held:
                    del owners[p]
            elif rid in hits.get(p, ()):
                del hits[p][rid]
            else:
                continue
            freed = pool.freed_by.setdefault(p, {})
            freed.pop(rid, None)
            freed[rid] = e
            if len(freed) > _FREED_KEPT:
                del freed[next(iter(freed))]

    def on_kv_written(self, e: dict) -> None:
        pool = self._pool(e)
        if pool is None:
            return
        rid = e["request_id"]
        hashes = e["block_hashes"] or [None] * len(e["pages"] or [])
        for p, h in zip(e["pages"] or [], hashes):
            if e["source"] == "transfer_in" and not pool.holds(p, rid):
                freed = pool.freed_by.get(p, {}).get(rid)
                if freed is not None:
                    self._report(
                        "no_free_before_drain",
                        freed,
                        f"{rid}'s write landed on page {p} after {rid} freed it (seq {e['seq']} of {e['node']})",
                    )
            pool.writer[p] = (rid, self.tenant.get(rid), h)

    def on_transfer_received(self, e: dict) -> None:
        key = (e["cluster"], e["node"], e["request_id"])
        if e["status"] == "unverified":
            pool = self._pool(e)
            if pool is not None:
                for p in e["pages"] or []:
                    pool.writer[p] = None  # writer unknown from now on
            return
        if e["status"] in ("ok", "mismatch"):
            self.received[key] = (e["num_tokens"], e)

    def on_transfer_reserved(self, e: dict) -> None:
        self.reserved[(e["cluster"], e["node"], e["request_id"])] = e["num_tokens"]

    def on_transfer_sent(self, e: dict) -> None:
        rid = e["request_id"]
        self.sent[rid] = self.sent.get(rid, 0) + (e["num_tokens"] or 0)
        stop = self.stopped.get((e["cluster"], e["node"], rid))
        if stop is not None:
            self._report(
                "aborted_never_sent",
                e,
                f"{e['node']} sends {rid}'s KV after recording it aborted at {stop['node']}:{stop['seq']}",
            )

    def on_kv_read(self, e: dict) -> None:
        pool = self._pool(e)
        if pool is None:
            return
        rid = e["request_id"]
        tenant = self.tenant.get(rid, e["tenant_id"])
        for p in e["pages"] or []:
            if not pool.holds(p, rid):
                self._report("no_foreign_read", e, f"{rid} reads page {p} it does not hold")
                break
            if p not in pool.writer:
                self._report("no_foreign_read", e, f"{rid} reads page {p}, never written since the pool began")
                break
            w = pool.writer[p]
            if w is None:
                self._unknown("no_foreign_read", "a read of pages an unverified transfer may have written", e)
                continue
            writer, wtenant, whash = w
            if writer == rid:
                continue
            hit = pool.hits.get(p, {}).get(rid)
            if hit is not None and hit == whash and wtenant == tenant:
                continue  # a sealed prefix of its own namespace
            why = "a prefix of another namespace" if hit is not None and hit == whash else "last written"
            self._report("no_foreign_read", e, f"{rid} ({tenant}) reads page {p}: {why} by {writer} ({wtenant})")
            break
        key = (e["cluster"], e["node"], rid)
        if key in self.reserved:
            want = self.reserved[key]
            got = self.received.get(key)
            if got is None:
                self._unknown("transferred_equals_reserved", "decode read with no receipt of the transfer", e)
            elif got[0] != want or self.sent.get(rid, want) != want:
                sent = self.sent.get(rid)
                self._report(
                    "transferred_equals_reserved",
                    got[1],
                    f"decode committed {rid}: {want} tokens reserved, {sent} sent, {got[0]} landed",
                )

    # ---- result ----------------------------------------------------------------------------------

    def coverage(self) -> list[dict]:
        out = []
        for (prop, why), evs in sorted(self.cannot_tell.items()):
            e = evs[0]
            out.append(
                {
                    "property": prop,
                    "cannot_tell": why,
                    "events": len(evs),
                    "first_event": {
                        "producer": f"{e['cluster']}/{e['node']}/{e['instance']}",
                        "seq": e["seq"],
                        "node": e["node"],
                        "request_id": e["request_id"],
                    },
                }
            )
        return out


def judge_order(table: pa.Table) -> list[int]:
    """Row numbers in the judge's order: wall time, then cluster, node, instance, seq."""
    keys = [(c, "ascending") for c in ("wall_ns", "cluster", "node", "instance", "seq")]
    return pc.sort_indices(table.select([k for k, _ in keys]), sort_keys=keys).to_pylist()


assert set(PROPERTIES) >= {"no_foreign_read", "aborted_never_sent", "no_free_before_drain"}
