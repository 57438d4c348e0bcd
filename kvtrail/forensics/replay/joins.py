"""The replay engine's cross-node findings: F2, F3, F4, F9 and F11 join events of several producers.

Events are collected as they stream by and joined when findings are asked for, so the order in which
different nodes' batches arrive does not matter. The join keys and each rule are stated in
``docs/findings.md`` ("Cross-node rules"); this module is their reference statement in code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from kvtrail.forensics.findings import late_transfer_detail, transfer_mismatch_detail
from kvtrail.forensics.policy import ForensicsPolicy
from kvtrail.forensics.replay.event import NodeKey, ReplayEvent, required
from kvtrail.forensics.replay.transfers import TransferEvents, TransferKey, transfers_by_request

_DIGESTED = ("ok", "mismatch")  # receipts decode took as landed: their digest is compared (F3)
PREFILL_ROLES = ("prefill", "unified")
# emit(code, event, **finding fields): EventHandlers.emit's signature
Emit = Callable[..., None]
# One forward write as a prefill-rate sample: (node_key, ord, wall_ns, request_id, tokens).
ForwardWrite = tuple[NodeKey, int, int, str | None, int]
RequestKey = tuple[str | None, str | None]  # (request_id, tenant_id): a request, as ReplayState keys it


def same_attempt(a: ReplayEvent, b: ReplayEvent) -> bool:
    """Two events of one request belong to the same attempt unless both name different transfer ids."""
    return a.transfer_id is None or b.transfer_id is None or a.transfer_id == b.transfer_id


def has_output(resp: ReplayEvent) -> bool:
    return required(resp.completion_tokens, "completion_tokens") > 0


@dataclass(eq=False, slots=True)
class _NodeSamples:
    """One node's prefill-rate samples so far: rates (tokens per ns) with their request ids, in write order."""

    rates: list[float] = field(default_factory=list)
    rids: list[str | None] = field(default_factory=list)
    prev: int | None = None  # wall_ns of the node's latest forward write taken
    last_ord: int = -1


class CrossNodeJoins:
    """State for F2/F3/F4/F9, fed by the replay engine; ``evaluate`` emits through a callback.

    The collecting methods named after an event kind are that kind's handlers.
    """

    def __init__(self, policy: ForensicsPolicy):
        self.policy = policy
        # request_id -> the first tenant named for it (the replay's ReplayState.tenants): an event naming no
        # tenant belongs to that tenant's request of its id
        self.tenants: dict[str, str] = {}
        self.transfers: dict[TransferKey, TransferEvents] = {}
        self.aborts: dict[str | None, list[ReplayEvent]] = {}  # by request_id
        self.aborted_at: set[tuple[NodeKey, str | None]] = set()
        self.responses: list[ReplayEvent] = []  # 2xx responses
        # first request_received per (node, request id) (rate samples start there) and per (node, request) (F9)
        self.receipts: dict[tuple[NodeKey, str | None], ReplayEvent] = {}
        self.request_receipts: dict[tuple[NodeKey, str | None, str | None], ReplayEvent] = {}
        self.forward_writes: list[ForwardWrite] = []
        # (node_key, request_id, tenant_id the events name) -> prefix-hit pages
        self.hit_pages: dict[tuple[NodeKey, str | None, str | None], int] = {}
        self.page_size: dict[NodeKey, int] = {}
        self.role: dict[NodeKey, str] = {}
        self.configs: dict[NodeKey, ReplayEvent] = {}  # the latest node_config per node (set by its handler)
        # prefill_rates' samples, kept from one evaluation to the next (an online replay evaluates every poll)
        self._samples: dict[NodeKey, _NodeSamples] = {}
        self._samples_seen = 0  # forward_writes taken into _samples
        self._samples_ord = -1  # the highest ord among them
        self._samples_stale = False  # a receipt arrived that an earlier sample should have seen
        self._deferred: dict[NodeKey, list[ForwardWrite]] = {}  # writes of nodes not (yet) prefill nodes
        # What each transfer's checks emitted, with the inputs they saw: a transfer whose events and
        # request's responses are unchanged emits the same again without being checked again.
        self._transfer_checks: dict[tuple, tuple[tuple, tuple, list[tuple]]] = {}

    def __getstate__(self) -> dict:  # the derived caches are not sent along (a lake's partitions are pickled)
        state = dict(self.__dict__)
        state.update(
            _samples={}, _samples_seen=0, _samples_ord=-1, _samples_stale=False, _deferred={}, _transfer_checks={}
        )
        return state

    # ---- collection ---------------------------------------------------------------------------------

    def tenant_of(self, ev: ReplayEvent) -> str | None:
        """The tenant of the request ``ev`` belongs to: its own, else the first named for its id."""
        if ev.tenant_id is not None or ev.request_id is None:
            return ev.tenant_id
        return self.tenants.get(ev.request_id)

    def request_of(self, ev: ReplayEvent) -> RequestKey:
        return (ev.request_id, self.tenant_of(ev))

    def _transfer(self, ev: ReplayEvent) -> TransferEvents:
        key = (ev.node_key[0], ev.transfer_id, ev.request_id, ev.tenant_id)
        t = self.transfers.get(key)
        if t is None:
            t = self.transfers[key] = TransferEvents()
        return t

    def transfer_reserved(self, ev: ReplayEvent) -> None:
        t = self._transfer(ev)
        t.reserved, t.reserved_cfg = ev, self.configs.get(ev.node_key)

    def transfer_sent(self, ev: ReplayEvent) -> None:
        self._transfer(ev).sent.append(ev)

    def transfer_received(self, ev: ReplayEvent) -> None:
        t = self._transfer(ev)
        t.received, t.received_cfg = ev, self.configs.get(ev.node_key)

    def request_aborted(self, ev: ReplayEvent) -> None:
        self.aborts.setdefault(ev.request_id, []).append(ev)
        self.aborted_at.add((ev.node_key, ev.request_id))

    def request_received(self, ev: ReplayEvent) -> None:
        self.request_receipts.setdefault((ev.node_key, ev.request_id, ev.tenant_id), ev)
        key = (ev.node_key, ev.request_id)
        if key not in self.receipts:
            self.receipts[key] = ev
            if ev.ord < self._samples_ord:  # not in feed order: the samples are derived again
                self._samples_stale = True

    def response_sent(self, ev: ReplayEvent) -> None:
        if 200 <= required(ev.http_status, "http_status") < 300:
            self.responses.append(ev)

    def written(self, ev: ReplayEvent) -> None:
        """A kv_written with a request id (forward writes are prefill-rate samples)."""
        if ev.source == "forward":
            tokens = required(ev.token_end, "token_end") - required(ev.token_start, "token_start")
            self.forward_writes.append((ev.node_key, ev.ord, ev.wall_ns, ev.request_id, tokens))

    def prefix_hit(self, ev: ReplayEvent, num_pages: int) -> None:
        key = (ev.node_key, ev.request_id, ev.tenant_id)
        self.hit_pages[key] = self.hit_pages.get(key, 0) + num_pages

    # ---- evaluation ---------------------------------------------------------------------------------

    def evaluate(self, emit: Emit) -> None:
        """Emit F2/F3/F11 per transfer, F4 and F9 per 2xx response (``emit(code, ev, **kw)``)."""
        by_request: dict[RequestKey, list[ReplayEvent]] = {}
        for resp in self.responses:
            by_request.setdefault(self.request_of(resp), []).append(resp)
        checks = self._transfer_checks
        paired: dict[RequestKey, list[RequestKey]] = {}  # decode's request -> its rooms' prefill requests
        for key, t in transfers_by_request(self.transfers, self.tenants).items():
            if t.prefill_request_id is not None:
                paired.setdefault((key[2], key[3]), []).append((t.prefill_request_id, t.prefill_tenant))
            responses = by_request.get((key[2], key[3]), ())
            # Everything the checks read: the transfer's events and configurations, the request's responses
            # (sends and responses are only ever appended; objects are compared by identity).
            seen = (
                t.reserved,
                t.received,
                t.reserved_cfg,
                t.received_cfg,
                t.sent[-1] if t.sent else None,
                responses[-1] if responses else None,
            )
            counts = (len(t.sent), len(responses))
            held = checks.get(key)
            if held is not None and held[1] == counts and all(a is b for a, b in zip(held[0], seen)):
                for code, ev, kw in held[2]:
                    emit(code, ev, **kw)
                continue
            out: list[tuple] = []

            def keep(code: str, ev: ReplayEvent, out: list[tuple] = out, **kw) -> None:
                out.append((code, ev, kw))
                emit(code, ev, **kw)

            tenant = key[3]
            if t.received is not None:
                _check_transfer(t, [r for r in responses if same_attempt(r, t.received)], tenant, keep)
            _check_duration(t, tenant, keep)
            checks[key] = (seen, counts, out)
        rates = self.prefill_rates()
        receipts_by = self._receipts_by_request()
        for resp in self.responses:
            me = self.request_of(resp)
            aborts = {
                a.key: a
                for a in self.aborts.get(resp.request_id, ())
                if resp.request_id is not None and same_attempt(a, resp) and self.request_of(a) == me
            }
            for pre in paired.get(me, ()):  # a bootstrap room's prefill abort is its decode request's too
                aborts.update(
                    (a.key, a)
                    for a in self.aborts.get(pre[0], ())
                    if a.node_key[0] == resp.node_key[0] and same_attempt(a, resp) and self.request_of(a) == pre
                )
            if aborts and has_output(resp):
                first = min(a.wall_ns for a in aborts.values())
                what = "; ".join(sorted({f"{a.stage}: {a.abort_reason} ({a.http_status})" for a in aborts.values()}))
                emit(
                    "F4",
                    resp,
                    request=resp.request_id,
                    tenant=me[1],
                    first_ns=first,
                    evidence=aborts,
                    detail=f"HTTP {resp.http_status} after abort: {what}",
                )
            self._check_latency(resp, rates, receipts_by, paired.get(me, ()), emit)

    def prefill_rates(self) -> dict[NodeKey, float]:
        """Per prefill node: the policy's quantile of its forward writes' rates (tokens per ns).

        A forward write is one sample: its tokens over the time since its compute could have started -
        not before its request reached the node, nor before the node's previous forward write (so time
        queued behind other requests does not count as compute on a busy node). Requests the node
        aborted are left out: a placeholder forward pass says nothing about the node's speed.

        The samples are kept between calls and only the writes collected since are added (a live judge
        asks every poll; deriving them all again made each poll grow with the history). A write's sample
        is final once taken: everything earlier in the engine's order was collected before it. Writes or
        receipts collected out of that order derive the affected samples again; aborts are applied when
        the quantile is taken, so one that arrives later still removes its request's samples.
        """
        self._take_samples()
        aborted: dict[NodeKey, set[str | None]] = {}
        for nk, rid in self.aborted_at:
            aborted.setdefault(nk, set()).add(rid)
        out = {}
        for nk, s in self._samples.items():
            if self.role.get(nk) not in PREFILL_ROLES:
                continue
            skip = aborted.get(nk)
            if skip and not skip.isdisjoint(s.rids):
                xs = [x for x, rid in zip(s.rates, s.rids) if rid not in skip]
            else:
                xs = s.rates
            if len(xs) >= self.policy.min_latency_samples:
                out[nk] = float(np.quantile(np.array(xs), self.policy.latency_quantile))
        return out

    def _take_samples(self) -> None:
        """Add the forward writes collected since the last call to ``_samples`` (all of them when stale).

        A node that is not a prefill node now has its writes set aside, not sampled (decode nodes write
        most pages); they are sampled if its role changes to one."""
        if self._samples_stale:
            self._samples, self._samples_seen, self._samples_ord, self._samples_stale = {}, 0, -1, False
            self._deferred = {}
        new = self.forward_writes[self._samples_seen :]
        self._samples_seen = len(self.forward_writes)
        by_node: dict[NodeKey, list[ForwardWrite]] = {}
        for w in new:
            by_node.setdefault(w[0], []).append(w)
        for nk in self._deferred:
            if nk not in by_node and self.role.get(nk) in PREFILL_ROLES:
                by_node[nk] = []
        for nk, writes in by_node.items():
            if self.role.get(nk) not in PREFILL_ROLES:
                self._deferred.setdefault(nk, []).extend(writes)
                continue
            held = self._deferred.pop(nk, None)
            if held:
                writes = held + writes
            writes.sort(key=lambda w: w[1])
            s = self._samples.get(nk)
            if s is not None and writes[0][1] <= s.last_ord:  # earlier than what it holds: this node again
                writes = sorted((w for w in self.forward_writes if w[0] == nk), key=lambda w: w[1])
                s = None
            if s is None:
                s = self._samples[nk] = _NodeSamples()
            prev = s.prev
            for _, ord_, wall, rid, tokens in writes:
                rec = self.receipts.get((nk, rid))
                start = prev
                if rec is not None and rec.ord < ord_ and (start is None or rec.wall_ns > start):
                    start = rec.wall_ns
                prev = wall
                if start is not None and tokens > 0 and wall > start:
                    s.rates.append(tokens / (wall - start))
                    s.rids.append(rid)
            s.prev, s.last_ord = prev, writes[-1][1]
            self._samples_ord = max(self._samples_ord, s.last_ord)

    def _receipts_by_request(self) -> dict[RequestKey, list[ReplayEvent]]:
        """Prefill-node receipts per request."""
        out: dict[RequestKey, list[ReplayEvent]] = {}
        for (nk, rid, _), rec in self.request_receipts.items():
            if rid is not None and self.role.get(nk) in PREFILL_ROLES:
                out.setdefault(self.request_of(rec), []).append(rec)
        return out

    def _hits(self, nk: NodeKey, request: RequestKey) -> int:
        """Prefix-hit pages of ``request`` on node ``nk`` (its events naming its tenant or, if it is the first
        named for the id, none)."""
        rid, tenant = request
        n = self.hit_pages.get((nk, rid, tenant), 0)
        if tenant is not None and self.tenants.get(rid) == tenant:  # type: ignore[arg-type]
            n += self.hit_pages.get((nk, rid, None), 0)
        return n

    def _check_latency(
        self,
        resp: ReplayEvent,
        rates: dict[NodeKey, float],
        receipts_by: dict[RequestKey, list[ReplayEvent]],
        prefill_requests: Sequence[RequestKey],
        emit: Emit,
    ) -> None:
        """F9 of one response; ``prefill_requests``: its bootstrap rooms' prefill-side requests (their receipts
        are its own)."""
        if resp.ttft_ns is None or resp.prompt_tokens is None or resp.request_id is None:
            return
        me = self.request_of(resp)
        found = [c for c in receipts_by.get(me, ()) if same_attempt(c, resp)]
        found += [
            c
            for pre in prefill_requests
            for c in receipts_by.get(pre, ())
            if same_attempt(c, resp) and c.node_key[0] == resp.node_key[0]
        ]
        if not found:
            return
        rec = min(found, key=lambda c: c.ord)
        nk = rec.node_key
        rate = rates.get(nk)
        if rate is None:
            return
        need = resp.prompt_tokens - self._hits(nk, self.request_of(rec)) * self.page_size.get(nk, 0)
        if need <= 0:
            return
        floor_ns = need / rate / self.policy.latency_factor
        if resp.ttft_ns < floor_ns:
            emit(
                "F9",
                resp,
                node=nk[1],
                request=resp.request_id,
                tenant=me[1],
                evidence=[rec.key],
                detail=f"TTFT {resp.ttft_ns / 1e6:.3f} ms for {need} tokens to prefill; {nk[1]} prefills "
                f"at {rate * 1e9:.0f} tokens/s (q{self.policy.latency_quantile:g}), so at least "
                f"{floor_ns / 1e6:.3f} ms (factor {self.policy.latency_factor:g})",
            )


def _paired(t: TransferEvents, detail: str) -> str:
    return detail if t.prefill_request_id is None else f"{detail}; prefill's request id: {t.prefill_request_id}"


def _check_transfer(t: TransferEvents, responses: list[ReplayEvent], tenant: str | None, emit: Emit) -> None:
    """F2 and F3 of one transfer; ``responses``: the request's 2xx responses (what the client got)."""
    res, rec, sent = t.reserved, t.received, t.sent
    assert rec is not None, "a transfer is checked at its receipt"
    evidence = [e.key for e in (res, *sent) if e is not None]
    first = min(e.wall_ns for e in (res, rec, *sent) if e is not None)
    if res is not None:
        problems = []
        if sent:
            sent_tokens = sum(required(e.num_tokens, "num_tokens") for e in sent)
            sent_pages = sum(e.num_dst_pages for e in sent)
            if sent_tokens != res.num_tokens or sent_pages != len(res.pages):
                problems.append(f"sent {sent_tokens} tokens/{sent_pages} pages")
        if rec.num_tokens != res.num_tokens:
            problems.append(f"received {rec.num_tokens} tokens")
        if problems:
            served = [r for r in responses if has_output(r)]
            emit(
                "F2",
                rec,
                request=rec.request_id,
                tenant=tenant,
                pages=res.pages,
                first_ns=first,
                evidence=evidence + [r.key for r in responses],
                severity="critical" if served else None,
                detail=_paired(
                    t,
                    transfer_mismatch_detail(
                        int(required(res.num_tokens, "num_tokens")),
                        len(res.pages),
                        problems,
                        str(rec.status),
                        [
                            (
                                int(required(r.http_status, "http_status")),
                                int(required(r.completion_tokens, "completion_tokens")),
                            )
                            for r in responses
                        ],
                    ),
                ),
            )
    if rec.status not in _DIGESTED:
        return
    with_digest = [e for e in sent if e.digest is not None]
    src = with_digest[-1] if with_digest else None
    if src is not None and rec.digest is not None and src.digest_algo == rec.digest_algo:
        if src.digest != rec.digest:
            emit(
                "F3",
                rec,
                request=rec.request_id,
                tenant=tenant,
                pages=rec.pages,
                first_ns=first,
                evidence=evidence,
                detail=_paired(
                    t, f"prefill digest {src.digest:#x} != decode digest {rec.digest:#x} ({rec.digest_algo})"
                ),
            )
    elif rec.status == "mismatch":
        emit(
            "F3",
            rec,
            request=rec.request_id,
            tenant=tenant,
            pages=rec.pages,
            first_ns=first,
            evidence=evidence,
            detail=_paired(t, "decode reported a digest mismatch"),
        )


def _check_duration(t: TransferEvents, tenant: str | None, emit: Emit) -> None:
    """F11: the transfer ran longer than its decode node holds the pages of an aborted transfer."""
    if not t.sent:
        return
    dec, cfg = (t.received, t.received_cfg) if t.received is not None else (t.reserved, t.reserved_cfg)
    if dec is None or cfg is None or cfg.release_timeout_ns is None:
        return
    start = min(e.wall_ns for e in t.sent)
    end = max((*t.sent, *((t.received,) if t.received is not None else ())), key=lambda e: e.wall_ns)
    if end.wall_ns - start > cfg.release_timeout_ns:
        node = dec.node_key[1]
        emit(
            "F11",
            end,
            node=node,
            request=dec.request_id,
            tenant=tenant,
            first_ns=start,
            evidence=[e.key for e in t.sent] + [dec.key, cfg.key],
            detail=_paired(t, late_transfer_detail(end.wall_ns - start, node, cfg.release_timeout_ns)),
        )
