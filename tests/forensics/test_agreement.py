"""Both engines against an oracle: random valid histories with planted violations of every kind.

Two generators. ``PageOracle`` drives one node's pool through admissions, growth, frees, prefix-cache
hits (same tenant: legitimate; another tenant: F10; a stale radix entry: F1) and the planted page bugs
(read after free F5, late write F7, double allocation F6), with page digests on writes and reads so F1
carries digest lineage. ``pd_history`` plays prefill -> decode transfers with planted length mismatches
(F2), digest mismatches (F3), rejected-but-served responses (F4), the incident's placeholder path
(F1 + F2 + F4 + F9) and a misconfigured pool (F8), under the clarified definitions: a late writer is a
source (its reader's F1 names it and says when its own KV was overwritten), F4 needs output, F2 counts
what landed whatever the receipt's status, and a transfer id shared by two requests joins neither with
the other. Each run checks that the replay engine and the SQL engine both report exactly what the
oracle planted: no more, no less.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtrail.audit.batch import from_dicts
from kvtrail.audit.store import AuditStore
from kvtrail.forensics.findings import foreign_read_detail
from kvtrail.forensics.replay.engine import replay_store
from kvtrail.forensics.sql.engine import sql_findings
from tests.forensics.test_replay import Oracle, Timeline

POOL = 10
TENANTS = ("acme", "globex")
PAGE_ACTIONS = (
    "admit",
    "admit",
    "read",
    "free",
    "grow",
    "read_after_free",
    "late_write",
    "double_alloc",
    "hit",
    "hit",
    "hit_cross",
    "hit_stale",
    "scribble",
    "late_then_read",
    "late_then_read",
    "unverified",
    "admit_reuse",
    "admit_reuse",
)


class PageOracle(Oracle):
    """The single-node oracle plus tenants, block hashes, prefix-cache hits and page digests."""

    def __init__(self, tl, data):
        super().__init__(tl)
        self.data = data
        self.bhash: dict[int, int] = {}  # page -> block hash its last writer stored (if any)
        self.wdigest: dict[int, int] = {}  # page -> digest its last writer recorded (if any)
        self.content: dict[int, int] = {}  # page -> digest of what the page holds now
        self.hits: dict[tuple[str, int], int] = {}  # (request, page) -> block hash of its hit
        self.stamp = 0
        self.gen: dict[int, int] = {}  # page -> exclusive allocations so far
        self.wgen: dict[int, int] = {}  # page -> its allocation count when last written
        self.late: dict[int, tuple] = {}  # page -> (writer, wgen) a late write overwrote; absent if on time

    def new_rid(self):
        rid = super().new_rid()
        self.tl.tenant_of[rid] = self.data.draw(st.sampled_from(TENANTS))
        return rid

    def write(self, rid, pages):
        self.stamp += 1
        with_digests = self.data.draw(st.booleans())
        digests = [self.stamp * 1000 + p for p in pages]
        hashes = [self.stamp * 100 + p for p in pages]
        kw = {"block_hashes": hashes}
        if with_digests:
            kw.update(page_digests=digests, digest_algo="kvtrail-page64")
        e = self.tl.write("d", rid, pages, **kw)
        out = [p for p in pages if rid not in self.holders[p]]
        if out:
            self._expect("F7", rid, set().union(*(self.holders[p] for p in out)), out, e)
        for p in pages:
            if p in out:
                self.late[p] = (self.writer.get(p), self.wgen.get(p))
            else:
                self.late.pop(p, None)
            self.wgen[p] = self.gen.get(p, 0)
        for p, d, h in zip(pages, digests, hashes):
            self.writer[p], self.bhash[p], self.content[p] = rid, h, d
            if with_digests:
                self.wdigest[p] = d
            else:
                self.wdigest.pop(p, None)
            self.fresh = {(r, q) for r, q in self.fresh if q != p}

    def read(self, rid, pages):
        digests = [self.content.get(p, 7) for p in pages]
        e = self.tl.add("d", "kv_read", rid, pages=pages, page_digests=digests, digest_algo="kvtrail-page64")
        out = [p for p in pages if rid not in self.holders[p]]
        if out:
            self._expect("F5", rid, set().union(*(self.holders[p] for p in out)), out, e)
        foreign, cross = {}, {}
        for p in pages:
            w = self.writer.get(p)
            hit = self.hits.get((rid, p)) if rid in self.holders[p] else None
            cached = hit is not None and self.bhash.get(p) == hit
            if w == rid or (rid, p) in self.fresh:
                continue
            if cached:
                if w is not None and self.tl.tenant_of[w] != self.tl.tenant_of[rid]:
                    cross.setdefault(w, []).append(p)
                continue
            foreign.setdefault(w, []).append(p)
        for w, ps in foreign.items():
            lineage, detail = (0, 0), None
            if w is not None:
                checked = [p for p in ps if p in self.wdigest]
                lineage = (len(checked), sum(self.wdigest[p] == self.content[p] for p in checked))
                late = [p for p in ps if p in self.late]
                lost = [p for p in late if self.late[p] == (rid, self.gen.get(p, 0))]
                detail = foreign_read_detail(self.tl.id_of.get(w, w), len(late), len(lost))
            self.expected.append(("F1", rid, (w,), tuple(sorted(ps)), e["wall_ns"], lineage, detail))
        for w, ps in cross.items():
            self._expect("F10", rid, {w}, ps, e)

    def _expect(self, code, rid, victims, pages, e):
        super()._expect(code, rid, victims, pages, e)
        self.expected[-1] = (*self.expected[-1], (0, 0), None)

    def alloc(self, rid, pages, purpose="prefill_extend"):
        super().alloc(rid, pages, purpose)
        for p in set(pages):
            self.gen[p] = self.gen.get(p, 0) + 1

    def hit(self, kind):
        written = sorted(p for p in self.writer if self.bhash.get(p) is not None)
        if not written:
            return False
        owner = self.writer[self.data.draw(st.sampled_from(written))]  # one radix path: one writer's pages
        mine = [p for p in written if self.writer[p] == owner]
        pages = sorted(self.data.draw(st.sets(st.sampled_from(mine), min_size=1, max_size=3)))
        rid = self.new_rid()
        same = self.tl.tenant_of[owner]
        other = next(t for t in TENANTS if t != same)
        self.tl.tenant_of[rid] = other if kind == "hit_cross" else same
        hashes = [self.bhash[p] + (1 if kind == "hit_stale" else 0) for p in pages]
        self.tl.alloc("d", rid, pages, "prefix_hit", block_hashes=hashes)
        for p, h in zip(pages, hashes):
            self.holders[p].add(rid)
            self.hits[(rid, p)] = h
        self.pages[rid] = list(pages)
        self.live.append(rid)
        self.read(rid, pages)
        return True

    def free(self, rid):
        super().free(rid)
        for p in self.pages[rid]:
            self.hits.pop((rid, p), None)

    def unverified(self, rid):
        """An unverified landing: no writer, no block hash or digest on record, no late write current."""
        super().unverified(rid)
        for p in self.pages[rid]:
            self.bhash.pop(p, None)
            self.wdigest.pop(p, None)
            self.late.pop(p, None)
            self.wgen[p] = self.gen.get(p, 0)

    def reuse(self, data) -> bool:
        """A new request of the other tenant that carries an existing request's id (clients choose ids)."""
        free = self.free_pages()
        tenants_of_id: dict[str, set[str]] = {}
        for r, t in self.tl.tenant_of.items():
            tenants_of_id.setdefault(self.tl.id_of.get(r, r), set()).add(t)
        ids = sorted(i for i, ts in tenants_of_id.items() if len(ts) == 1)
        if not free or not ids:
            return False
        shared = data.draw(st.sampled_from(ids))
        rid = self.new_rid()
        self.tl.id_of[rid] = shared
        self.tl.tenant_of[rid] = next(t for t in TENANTS if t not in tenants_of_id[shared])
        self.alloc(rid, free[: data.draw(st.integers(1, min(3, len(free))))])
        self.write(rid, self.pages[rid])
        self.live.append(rid)
        return True

    def named(self, rid):
        """(request id, tenant) as findings name the request ``rid`` (None: nobody)."""
        return (None, None) if rid is None else (self.tl.id_of.get(rid, rid), self.tl.tenant_of[rid])

    def planted(self):
        """The expected findings with each request named as the engines name it: (id, tenant)."""
        out = []
        for code, rid, victims, pages, wall, lineage, detail in self.expected:
            vic = tuple(sorted(map(self.named, victims), key=_by_id))
            out.append((code, self.named(rid), vic, pages, wall, lineage, detail))
        return sorted(out, key=repr)

    def step(self, action, data):
        if action in ("hit", "hit_cross", "hit_stale"):
            return self.hit(action)
        if action == "admit_reuse":
            return self.reuse(data)
        if action == "late_then_read" and self.freed:  # the late write's reader: the recipient
            rid = data.draw(st.sampled_from(self.freed))
            self.write(rid, self.pages[rid])
            readers = sorted({h for p in self.pages[rid] for h in self.holders[p]})
            if readers:
                reader = data.draw(st.sampled_from(readers))
                self.read(reader, self.pages[reader])
            return True
        if action == "scribble" and self.content:  # bytes change with no event: lineage no longer matches
            p = data.draw(st.sampled_from(sorted(self.content)))
            self.content[p] += 1
            return True
        return super().step(action, data)


def both_engines(events, from_ns=None, to_ns=None):
    with AuditStore(":memory:") as store:
        store.append(from_dicts(events))
        replay = replay_store(store.con, from_ns, to_ns)
        sql = sql_findings(store.con, from_ns, to_ns)
    return replay, sql


def _by_id(v):
    return (v[0] is None, v[0] or "", v[1] is None, v[1] or "")


def _as_expected(f):
    lineage = (f.lineage_checked, f.lineage_matched)
    detail = f.detail if f.code == "F1" and f.victim_request_ids != (None,) else None
    vic = tuple(sorted(zip(f.victim_request_ids, f.victim_tenant_ids), key=_by_id))
    return (f.code, (f.request_id, f.tenant_id), vic, tuple(sorted(f.pages)), f.last_ns, lineage, detail)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_page_findings_of_both_engines_are_exactly_the_planted_ones(data):
    tl = Timeline()
    tl.node("d", pool_pages=POOL)
    oracle = PageOracle(tl, data)
    for action in data.draw(st.lists(st.sampled_from(PAGE_ACTIONS), max_size=30)):
        oracle.step(action, data)
    want = oracle.planted()
    for engine in both_engines(tl.events):
        assert sorted(map(_as_expected, engine), key=repr) == want


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_legitimate_prefix_sharing_alone_is_clean(data):
    tl = Timeline()
    tl.node("d", pool_pages=POOL)
    oracle = PageOracle(tl, data)
    actions = data.draw(st.lists(st.sampled_from(("admit", "hit", "free", "grow", "read")), min_size=8, max_size=25))
    for action in ["admit", "hit"] + actions:
        oracle.step(action, data)
    assert oracle.expected == []
    assert any(e["kind"] == "pages_allocated" and e["purpose"] == "prefix_hit" for e in tl.events)
    assert all(engine == [] for engine in both_engines(tl.events))


# ---- cross-node: transfers, aborts, latency, configuration ---------------------------------------------

PD_KINDS = (
    "clean",
    "clean",
    "clean",
    "short_send",
    "bad_digest",
    "receiver_mismatch",
    "rejected_served",
    "placeholder",
    "failed_short",
    "aborted_empty",
    "collide",
    "collide_short",
    "room",
    "room_short_send",
    "room_bad_digest",
    "room_placeholder",
    "room_rejected_served",
)
# room*: SGLang's PD, where the transfer id is the bootstrap room and prefill records the request under its own id
# (p<i>, its own tenant) while decode and the router use q<i>: one transfer, named by decode's id. Decode's
# receipt agrees with its reservation, so only the pair's comparison (prefill's send) can find the F2 / F3, and
# prefill's abort (under p<i>) is the served request's F4.


def pd_history(data):
    """Prefill 'p' (1 token per ns), decode 'd' (pages never reused), router; returns (events, expected)."""
    tl = Timeline()
    misconfigured = data.draw(st.booleans())
    tl.node("p", "prefill", pool_pages=64, page_size=16, context_tokens=4096 if misconfigured else None)
    tl.node("d", "decode", pool_pages=4096, page_size=16)
    tl.node("router", "router")
    expected = [("F8", None, tl.events[0]["wall_ns"])] if misconfigured else []
    kinds = data.draw(st.lists(st.sampled_from(PD_KINDS), min_size=1, max_size=12))
    next_page = 1
    clean_samples = 0
    placeholders = []
    for i, kind in enumerate(kinds):
        rid, tid = f"q{i}", 1000 + i
        room = kind.startswith("room")
        kind = {"room": "clean"}.get(kind, kind.removeprefix("room_"))
        pre = f"p{i}" if room else rid  # prefill's request id
        if kind.startswith("collide") and i > 0 and not kinds[i - 1].startswith("room"):  # the previous id, reused
            tid -= 1
        pages = data.draw(st.integers(1, 4))
        tokens = 16 * pages - data.draw(st.integers(0, 15))
        dst = list(range(next_page, next_page + pages))
        next_page += pages
        recv = tl.add("p", "request_received", pre, tid, prompt_tokens=tokens)
        tl.add("d", "transfer_reserved", rid, tid, pages=dst, num_tokens=tokens)
        tl.alloc("d", rid, dst, "decode_reservation")
        if kind in ("rejected_served", "placeholder", "aborted_empty"):
            tl.add("p", "request_aborted", pre, tid, stage="prefill_queue", abort_reason="too long", http_status=400)
        computed = 1 if kind == "placeholder" else tokens
        src = [1 + i % 60]
        tl.alloc("p", pre, src)
        w = tl.add("p", "kv_written", pre, pages=src, token_start=0, token_end=computed, source="forward")
        recv["wall_ns"] = w["wall_ns"] - computed  # prefill runs at 1 token/ns
        sent_tokens = (
            tokens - 1 if kind in ("short_send", "collide_short") else (1 if kind == "placeholder" else tokens)
        )
        landed = dst[:1] if kind == "placeholder" else dst
        digest = 50 + i
        tl.add(
            "p",
            "transfer_sent",
            pre,
            tid,
            pages=src * len(landed),
            dst_pages=landed,
            num_tokens=sent_tokens,
            is_last_chunk=True,
            digest=digest,
            digest_algo="adler32",
        )
        tl.free("p", pre, src)
        tl.write("d", rid, landed, source="transfer_in")
        got_digest = digest + 1 if kind == "bad_digest" else digest
        status = {"receiver_mismatch": "mismatch", "failed_short": "failed"}.get(kind, "ok")
        landed_tokens = tokens // 2 if kind == "failed_short" else tokens if room else sent_tokens
        rec = tl.add(
            "d",
            "transfer_received",
            rid,
            tid,
            pages=landed,
            num_tokens=landed_tokens,
            status=status,
            **({} if kind == "receiver_mismatch" else {"digest": got_digest, "digest_algo": "adler32"}),
        )
        rd = tl.read("d", rid, dst)
        tl.free("d", rid, dst)
        ttft = 1 if kind == "placeholder" else int(tokens * 1.5) + 1000
        resp = tl.add(
            "router",
            "response_sent",
            rid,
            tid,
            http_status=200,
            prompt_tokens=tokens,
            completion_tokens=0 if kind == "aborted_empty" else 3,
            latency_ns=ttft + 10,
            ttft_ns=ttft,
        )
        if landed_tokens != tokens or sent_tokens != tokens:  # a 1-token prompt's placeholder sends what was reserved
            expected.append(("F2", rid, rec["wall_ns"]))
        if kind in ("bad_digest", "receiver_mismatch"):
            expected.append(("F3", rid, rec["wall_ns"]))
        if kind in ("rejected_served", "placeholder"):  # an abort, then a 2xx with output
            expected.append(("F4", rid, resp["wall_ns"]))
        elif kind != "aborted_empty":  # an aborted request's forward pass is no rate sample
            clean_samples += 1
        if kind == "placeholder":
            if len(dst) > 1:
                expected.append(("F1", rid, rd["wall_ns"]))  # the reserved pages nothing landed in
            # at 1 token/ns and factor 2, a 1 ns TTFT is implausible for more than 2 tokens (a room's receipt,
            # under p<i>, is its decode request's)
            if tokens > 2:
                placeholders.append((rid, resp["wall_ns"]))
    # Receipts were moved back in time (to just before their forward pass): restore time order.
    tl.events.sort(key=lambda e: e["wall_ns"])
    for node in tl.seqs:
        for n, e in enumerate(e for e in tl.events if e["producer"]["node"] == node):
            e["seq"] = n
    if clean_samples >= 3:  # the node's rate is known (1 token/ns)
        expected += [("F9", rid, wall) for rid, wall in placeholders]
    return tl.events, expected


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_cross_node_findings_of_both_engines_are_exactly_the_planted_ones(data):
    events, expected = pd_history(data)
    want = sorted(expected, key=repr)
    for engine in both_engines(events):
        got = [(f.code, f.request_id if f.code != "F8" else None, f.last_ns) for f in engine]
        assert sorted(got, key=repr) == want


class _Scripted:
    """A stand-in for hypothesis' ``data``: each draw takes the next scripted value."""

    def __init__(self, values: list) -> None:
        self._values = iter(values)

    def draw(self, strategy):
        return next(self._values)


def test_a_rooms_placeholder_is_judged_through_its_prefill_ids_abort_and_receipt():
    """The incident through a router, where prefill and decode name the request differently: prefill's abort
    and receipt (under p3) are decode's q3's, so F4 and F9 find the served placeholder, as F2 and F1 do."""
    kinds = ["clean", "clean", "clean", "room_placeholder"]
    events, expected = pd_history(_Scripted([False, kinds] + [2, 0] * len(kinds)))
    assert {c for c, r, _ in expected if r == "q3"} == {"F1", "F2", "F4", "F9"}
    for engine in both_engines(events):
        got = [(f.code, f.request_id if f.code != "F8" else None, f.last_ns) for f in engine]
        assert sorted(got, key=repr) == sorted(expected, key=repr)
