"""The model's transitions: every step one node (router, prefill, decode, the network) can take.

``successors(state)`` yields ``(label, next_state, violations)``: ``label`` is ``(action, request,
argument)`` (the argument: the chunk a write step moves, or nothing), ``violations`` the properties
the step itself breaks (``(property, detail)``). The state-invariant property (``pages_conserved``)
is checked on states, in :mod:`kvtrail.model.properties`.
"""

from __future__ import annotations

from itertools import permutations

from kvtrail.model.state import (
    ABORT,
    CHUNKS,
    D_ABORT_WAIT,
    D_ASKED,
    D_FINISHED,
    D_NONE,
    D_QUARANTINE,
    D_READ,
    D_REFUSED,
    D_RELEASED,
    D_RUNNING,
    D_WAITING,
    DPAGES,
    HIT,
    LONG,
    N_ACK,
    N_DONE,
    N_FAILED,
    NOTE,
    NSEND,
    P_FORWARDED,
    P_NEW,
    P_QUEUED,
    P_SENDING,
    P_SENT,
    P_STOPPED,
    PA,
    PPAGES,
    R_ERROR,
    R_NONE,
    R_OK,
    REJ,
    RESP,
    TENANT,
    TENANTS,
    W_COMPLETE,
    W_NONE,
    W_POSTED,
    W_VISIBLE,
    D,
    P,
    State,
    request_name,
)
from kvtrail.model.variants import Variant

Label = tuple  # (action, request index, argument)


class Transitions:
    """The successor function of one variant, with ``chunks`` pages per request and a reuse order."""

    def __init__(self, variant: Variant, chunks: int, reuse: str):
        self.v = variant
        self.k = chunks
        self.reuse = reuse

    # ---- pools ---------------------------------------------------------------------------------

    def _decode_choices(self, dfree: tuple) -> list[tuple[tuple, tuple]]:
        """(pages, remaining free list) for each way decode's allocator may hand out ``k`` pages."""
        k = self.k
        if len(dfree) < k:
            return []
        if self.reuse == "lowest":
            return [(dfree[:k], dfree[k:])]
        if self.reuse == "lifo":
            return [(tuple(reversed(dfree[-k:])), dfree[:-k])]
        out = []
        for pages in permutations(dfree, k):
            out.append((pages, tuple(p for p in dfree if p not in pages)))
        return out

    def _dfree_add(self, dfree: tuple, pages) -> tuple:
        if self.reuse == "lifo":
            return dfree + tuple(pages)
        return tuple(sorted(dfree + tuple(pages)))

    def _release_decode(self, reqs, dpool, dfree, i: int, viol: list) -> tuple:
        """Decode frees request i's pages; breaks ``no_free_before_drain`` if a write may still land."""
        r = reqs[i]
        in_flight = [c for c, w in enumerate(r[CHUNKS]) if w in (W_POSTED, W_COMPLETE)]
        may_post = r[PA] == 0 and r[P] in (P_QUEUED, P_FORWARDED, P_SENDING)
        if in_flight or may_post:
            why = f"chunks {in_flight} in flight" if in_flight else "prefill may still post its writes"
            viol.append(("no_free_before_drain", f"{request_name(i)} freed decode pages {list(r[DPAGES])}: {why}"))
        freed = [p for p in r[DPAGES] if dpool[p][0] == i]
        for p in freed:
            dpool[p] = (-1, dpool[p][1], dpool[p][2])
        return self._dfree_add(dfree, freed)

    def _release_prefill(self, reqs, ppool, pfree, i: int, seal: bool) -> tuple:
        r = reqs[i]
        bit = 1 << i
        freed = []
        for n, p in enumerate(r[PPAGES]):
            holders, ns, w = ppool[p]
            holders &= ~bit
            if seal and n == 0 and not r[HIT]:
                ns = r[TENANT]  # the full first page goes into the tenant's radix cache, sealed
            ppool[p] = (holders, ns, w)
            if holders == 0 and ns < 0:
                freed.append(p)
        if self.reuse == "lifo":
            return pfree + tuple(freed)
        return tuple(sorted(pfree + tuple(freed)))

    # ---- successors ----------------------------------------------------------------------------

    def successors(self, s: State):
        out: list = []
        for i, r in enumerate(s.reqs):
            self._router(s, i, r, out)
            self._prefill(s, i, r, out)
            self._network(s, i, r, out)
            self._decode(s, i, r, out)
        return out

    @staticmethod
    def _with(s: State, i: int, r: list, **pools) -> State:
        reqs = list(s.reqs)
        r_t = tuple(r)
        reqs[i] = _settled(r_t)
        return State(
            tuple(reqs),
            tuple(pools.get("dpool", s.dpool)),
            pools.get("dfree", s.dfree),
            tuple(pools.get("ppool", s.ppool)),
            pools.get("pfree", s.pfree),
        )

    def _router(self, s: State, i: int, r: tuple, out: list) -> None:
        if r[ABORT] == 0 and r[RESP] == R_NONE:
            rl = list(r)
            rl[ABORT], rl[RESP] = 1, R_ERROR  # the client went away: the router answers 499 and aborts
            out.append((("client_abort", i, None), self._with(s, i, rl), ()))

    def _prefill(self, s: State, i: int, r: tuple, out: list) -> None:
        v, p = self.v, r[P]
        if p == P_NEW:
            rl = list(r)
            if r[LONG]:
                rl[REJ] = 1  # over the prefill pool: marked rejected
                if v.reject_long:
                    rl[P] = P_STOPPED
                    if rl[RESP] == R_NONE:
                        rl[RESP] = R_ERROR
                    out.append((("reject", i, None), self._with(s, i, rl), ()))
                    return
                rl[NSEND] = 1  # the placeholder: one page of input goes on
            else:
                rl[NSEND] = self.k
            rl[P] = P_QUEUED
            if r[ABORT] == 0:
                rl[D] = D_ASKED  # the router tells decode the prompt's announced length
            out.append((("admit", i, None), self._with(s, i, rl), ()))
        if r[ABORT] and r[PA] == 0 and p in (P_NEW, P_QUEUED, P_FORWARDED, P_SENDING):
            rl = list(r)
            rl[PA], rl[P] = 1, P_STOPPED
            ppool, pfree = list(s.ppool), s.pfree
            if r[PPAGES]:
                pfree = self._release_prefill(s.reqs, ppool, pfree, i, seal=False)
            if r[DPAGES] and rl[NOTE] == 0:
                rl[NOTE] = N_ACK  # nothing more will be posted; ordered behind the posted writes
            out.append((("prefill_abort", i, None), self._with(s, i, rl, ppool=ppool, pfree=pfree), ()))
        if p == P_QUEUED and r[DPAGES] and r[PA] == 0:
            self._forward(s, i, r, out)
        if p in (P_FORWARDED, P_SENDING) and r[PA] == 0:
            chunks = r[CHUNKS]
            unposted = [c for c in range(r[NSEND]) if chunks[c] == W_NONE]
            if unposted:
                post = unposted[:1] if v.chunked else unposted
                rl = list(r)
                ch = list(chunks)
                for c in post:
                    ch[c] = W_POSTED
                rl[CHUNKS], rl[P] = tuple(ch), P_SENDING
                viol: tuple = ()
                if r[REJ]:
                    viol = (("aborted_never_sent", f"{request_name(i)} was rejected, yet prefill posts its KV"),)
                out.append((("post", i, tuple(post)), self._with(s, i, rl), viol))
            elif all(chunks[c] >= W_COMPLETE for c in range(r[NSEND])):
                rl = list(r)
                rl[P], rl[NOTE] = P_SENT, N_DONE
                ppool = list(s.ppool)
                pfree = self._release_prefill(s.reqs, ppool, s.pfree, i, seal=self.v.prefix_cache and not r[REJ])
                out.append((("notify", i, None), self._with(s, i, rl, ppool=ppool, pfree=pfree), ()))
            if p == P_SENDING:
                rl = list(r)
                rl[P], rl[NOTE] = P_STOPPED, N_FAILED
                ppool = list(s.ppool)
                pfree = self._release_prefill(s.reqs, ppool, s.pfree, i, seal=False)
                out.append((("transfer_fail", i, None), self._with(s, i, rl, ppool=ppool, pfree=pfree), ()))

    def _forward(self, s: State, i: int, r: tuple, out: list) -> None:
        need = r[NSEND]
        ppool, pfree = list(s.ppool), s.pfree
        pages: list[int] = []
        hit = 0
        if self.v.prefix_cache and need == self.k:
            for p, (holders, ns, w) in enumerate(ppool):
                if ns == r[TENANT]:
                    pages.append(p)
                    ppool[p] = (holders | (1 << i), ns, w)
                    hit = 1
                    break
        fresh = need - len(pages)
        if len(pfree) < fresh:  # evict unheld cached pages to make room (radix eviction)
            for p, (holders, ns, w) in enumerate(ppool):
                if len(pfree) >= fresh:
                    break
                if holders == 0 and ns >= 0:
                    ppool[p] = (0, -1, w)
                    pfree = self._pfree_sorted(pfree + (p,))
        rl = list(r)
        if len(pfree) < fresh:
            rl[P], rl[NOTE] = P_STOPPED, N_FAILED  # prefill pool exhausted: decode is told the transfer failed
            out.append((("prefill_exhausted", i, None), self._with(s, i, rl, ppool=s.ppool, pfree=s.pfree), ()))
            return
        if self.reuse == "lifo":
            got, pfree = tuple(reversed(pfree[len(pfree) - fresh :])), pfree[: len(pfree) - fresh]
        else:
            got, pfree = pfree[:fresh], pfree[fresh:]
        viol = []
        for p in got:
            ppool[p] = (1 << i, -1, i)  # the forward pass writes the request's own pages
        for p in pages:
            w = ppool[p][2]
            if w < 0 or s.reqs[w][TENANT] != r[TENANT]:
                viol.append(("no_foreign_read", f"{request_name(i)} attends to prefill page {p}, not its namespace's"))
        rl[PPAGES], rl[HIT], rl[P] = tuple(pages) + tuple(got), hit, P_FORWARDED
        out.append((("forward", i, None), self._with(s, i, rl, ppool=ppool, pfree=pfree), tuple(viol)))

    def _pfree_sorted(self, pfree: tuple) -> tuple:
        return pfree if self.reuse == "lifo" else tuple(sorted(pfree))

    def _network(self, s: State, i: int, r: tuple, out: list) -> None:
        chunks = r[CHUNKS]
        for c, w in enumerate(chunks):
            if w == W_POSTED:
                rl = list(r)
                rl[CHUNKS] = chunks[:c] + (W_COMPLETE,) + chunks[c + 1 :]
                out.append((("complete", i, c), self._with(s, i, rl), ()))
            elif w == W_COMPLETE:
                rl = list(r)
                rl[CHUNKS] = chunks[:c] + (W_VISIBLE,) + chunks[c + 1 :]
                page = r[DPAGES][c]
                dpool = list(s.dpool)
                dpool[page] = (dpool[page][0], i, int(dpool[page][0] != i))
                out.append((("land", i, c), self._with(s, i, rl, dpool=dpool), ()))

    def _decode(self, s: State, i: int, r: tuple, out: list) -> None:
        v, d = self.v, r[D]
        drained = all(w in (W_NONE, W_VISIBLE) for w in r[CHUNKS])
        if d == D_ASKED:
            choices = self._decode_choices(s.dfree)
            if not choices:
                rl = list(r)
                rl[D] = D_REFUSED
                if rl[RESP] == R_NONE:
                    rl[RESP] = R_ERROR
                if rl[P] == P_QUEUED:
                    rl[P] = P_STOPPED  # prefill is told to drop it (nothing allocated there yet)
                out.append((("decode_refuse", i, None), self._with(s, i, rl), ()))
            for pages, dfree in choices:
                rl = list(r)
                rl[D], rl[DPAGES] = D_WAITING, pages
                dpool = list(s.dpool)
                for p in pages:
                    dpool[p] = (i, dpool[p][1], dpool[p][2])
                out.append((("reserve", i, pages), self._with(s, i, rl, dpool=dpool, dfree=dfree), ()))
            return
        if d == D_WAITING and r[NOTE] == N_DONE and drained:
            rl = list(r)
            viol: list = []
            if r[NSEND] != self.k and v.check_length:
                dpool = list(s.dpool)
                dfree = self._release_decode(s.reqs, dpool, s.dfree, i, viol)
                rl[D] = D_RELEASED
                if rl[RESP] == R_NONE:
                    rl[RESP] = R_ERROR
                out.append((("commit_refused", i, None), self._with(s, i, rl, dpool=dpool, dfree=dfree), tuple(viol)))
            else:
                if r[NSEND] != self.k:
                    viol.append(
                        (
                            "transferred_equals_reserved",
                            f"{request_name(i)} committed {r[NSEND]} transferred pages of {self.k} reserved",
                        )
                    )
                rl[D] = D_RUNNING
                out.append((("commit", i, None), self._with(s, i, rl), tuple(viol)))
        if d == D_RUNNING:
            self._read(s, i, r, out)
        if d == D_READ:
            rl = list(r)
            viol = []
            dpool = list(s.dpool)
            dfree = self._release_decode(s.reqs, dpool, s.dfree, i, viol)
            rl[D] = D_FINISHED
            if rl[RESP] == R_NONE:
                rl[RESP] = R_OK
            out.append((("finish", i, None), self._with(s, i, rl, dpool=dpool, dfree=dfree), tuple(viol)))
        if r[ABORT] and d in (D_WAITING, D_RUNNING, D_READ):
            rl = list(r)
            viol = []
            if d == D_WAITING and v.deferred_release:
                rl[D] = D_ABORT_WAIT  # pages kept until prefill's answer (or the release timeout)
                out.append((("decode_abort", i, None), self._with(s, i, rl), ()))
            else:
                dpool = list(s.dpool)
                dfree = self._release_decode(s.reqs, dpool, s.dfree, i, viol)
                rl[D] = D_RELEASED
                out.append((("decode_abort", i, None), self._with(s, i, rl, dpool=dpool, dfree=dfree), tuple(viol)))
        if d in (D_WAITING, D_ABORT_WAIT) and r[NOTE] == N_FAILED:
            rl = list(r)
            viol = []
            if rl[RESP] == R_NONE:
                rl[RESP] = R_ERROR
            if v.quarantine_failed:
                rl[D] = D_QUARANTINE  # a failed batch may still be writing: hold the pages
                out.append((("fail_received", i, None), self._with(s, i, rl), ()))
            else:
                dpool = list(s.dpool)
                dfree = self._release_decode(s.reqs, dpool, s.dfree, i, viol)
                rl[D] = D_RELEASED
                out.append((("fail_received", i, None), self._with(s, i, rl, dpool=dpool, dfree=dfree), tuple(viol)))
        if d == D_ABORT_WAIT and r[NOTE] in (N_DONE, N_ACK) and drained:
            self._release_step(s, i, r, "drained", out)
        timeout_ok = d == D_QUARANTINE or (d == D_ABORT_WAIT and v.release_timeout)
        may_post = r[PA] == 0 and r[P] in (P_QUEUED, P_FORWARDED, P_SENDING)
        # the drain bound: a transfer call ends before the release timeout, so the timeout path is
        # taken only once nothing of the request is in flight or still to be posted
        if timeout_ok and drained and not may_post:
            self._release_step(s, i, r, "release_timeout", out)

    def _release_step(self, s: State, i: int, r: tuple, action: str, out: list) -> None:
        rl = list(r)
        viol: list = []
        dpool = list(s.dpool)
        dfree = self._release_decode(s.reqs, dpool, s.dfree, i, viol)
        rl[D] = D_RELEASED
        out.append(((action, i, None), self._with(s, i, rl, dpool=dpool, dfree=dfree), tuple(viol)))

    def _read(self, s: State, i: int, r: tuple, out: list) -> None:
        rl = list(r)
        pages = r[DPAGES]
        if self.v.page_tags and any(s.dpool[p][0] != i for p in pages):
            viol: list = []
            dpool = list(s.dpool)
            dfree = self._release_decode(s.reqs, dpool, s.dfree, i, viol)
            rl[D] = D_RELEASED
            if rl[RESP] == R_NONE:
                rl[RESP] = R_ERROR
            out.append((("tag_refused", i, None), self._with(s, i, rl, dpool=dpool, dfree=dfree), tuple(viol)))
            return
        viol = []
        tenant = TENANTS[r[TENANT]]
        for p in pages:
            owner, w, late = s.dpool[p]
            if w == i and owner == i:
                continue
            if w < 0:
                whose = "never written"
            elif w == i:
                whose = "its own, but not held"
            else:
                how = "a late write of" if late else "last written by"
                whose = f"{how} {request_name(w)} ({TENANTS[s.reqs[w][TENANT]]})"
            viol.append(("no_foreign_read", f"{request_name(i)} ({tenant}) reads decode page {p}: {whose}"))
        rl[D] = D_READ
        out.append((("read", i, None), self._with(s, i, rl), tuple(viol)))


def _settled(r: tuple) -> tuple:
    """A request that is over forgets its page tables, so finished requests compare equal."""
    if not r[DPAGES] and not r[PPAGES]:
        return r
    if r[RESP] == R_NONE or r[P] not in (P_SENT, P_STOPPED) or r[D] not in (D_NONE, D_FINISHED, D_RELEASED, D_REFUSED):
        return r
    if W_POSTED in r[CHUNKS] or W_COMPLETE in r[CHUNKS]:
        return r
    return r[:DPAGES] + ((), ()) + r[HIT:]


assert R_OK != R_ERROR and D_NONE == 0
