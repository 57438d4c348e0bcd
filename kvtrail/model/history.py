"""A counterexample as the history an audited deployment would have recorded: events-v1 dicts per producer.

Three producers (the router, ``prefill-0``, ``decode-0``), each numbered from 0 and closed cleanly, one
millisecond of wall time per model step. A write becomes ``kv_written`` on decode when it becomes
visible there (the reference stack records it when the transfer's completion arrives: the same order
for the judge), the sender's completion records nothing. ``kvtrail model check --trace-out`` writes one
JSON-lines file per producer, which ``kvtrail audit ingest`` stores as one batch each.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvtrail.model.checker import Counterexample, Step
from kvtrail.model.state import (
    DPAGES,
    LONG,
    NSEND,
    PPAGES,
    R_NONE,
    R_OK,
    RESP,
    TENANT,
    TENANTS,
    State,
)
from kvtrail.model.variants import Variant

T0_NS = 1_788_960_120_000_000_000  # 2026-09-09T13:22:00Z: a fixed start, so a history never depends on the clock
STEP_NS = 1_000_000
PAGE_TOKENS = 16
COMPLETION_TOKENS = 4
CLUSTER = "model"
NODES = {"router": "router-0", "prefill": "prefill-0", "decode": "decode-0"}
# the HTTP status the client gets when a step answers it with an error
ERROR_STATUS = {
    "client_abort": 499,
    "reject": 400,
    "decode_refuse": 503,
    "commit_refused": 500,
    "fail_received": 500,
    "tag_refused": 500,
}


def request_id(i: int) -> str:
    return f"model-r{i}"


class _Producer:
    def __init__(self, role: str, instance: str):
        self.producer = {
            "cluster": CLUSTER,
            "node": NODES[role],
            "role": role,
            "engine": "kvtrail-model",
            "engine_version": "1",
            "instance": instance,
        }
        self.events: list[dict] = []
        self.last_ns = 0

    def add(self, kind: str, wall_ns: int, request: dict | None = None, **payload) -> None:
        wall_ns = max(wall_ns, self.last_ns + 1)
        self.last_ns = wall_ns
        e = {
            "schema_version": 1,
            "producer": self.producer,
            "seq": len(self.events),
            "wall_ns": wall_ns,
            "mono_ns": wall_ns - T0_NS + 1,
            "kind": kind,
        }
        if request is not None:
            e["request"] = request
        e.update(payload)
        self.events.append(e)


class HistoryWriter:
    """Turns one counterexample's steps into the three producers' events."""

    def __init__(self, variant: Variant, num_pages: int, num_chunks: int, instance: str):
        self.v, self.m, self.k = variant, num_pages, num_chunks
        self.prods = {role: _Producer(role, f"{instance}-{role}") for role in NODES}

    def _ref(self, s: State, i: int) -> dict:
        tenant = TENANTS[s.reqs[i][TENANT]]
        return {"request_id": request_id(i), "transfer_id": i + 1, "tenant_id": tenant, "api_key_id": f"key-{tenant}"}

    def prompt_tokens(self, s: State, i: int) -> int:
        # a long prompt is over the prefill pool; decode is told it fills the request's reserved pages
        return (self.m + 1) * PAGE_TOKENS if s.reqs[i][LONG] else self.k * PAGE_TOKENS

    def events(self, steps: list[Step]) -> dict[str, list[dict]]:
        """Per node name, its events in seq order."""
        t = T0_NS
        first = steps[0].before if steps else None
        for role, prod in self.prods.items():
            prod.add("recorder_started", t, flush_interval_ns=STEP_NS)
            if role != "router":
                self._config(prod, role, t)
        if first is not None:
            for i in range(len(first.reqs)):
                self.prods["router"].add(
                    "request_received", t, self._ref(first, i), prompt_tokens=self.prompt_tokens(first, i)
                )
        for n, step in enumerate(steps, start=1):
            self._step(step, T0_NS + n * STEP_NS)
        end = T0_NS + (len(steps) + 1) * STEP_NS
        for prod in self.prods.values():
            prod.add("recorder_closed", end, dropped_events=0)
        return {prod.producer["node"]: prod.events for prod in self.prods.values()}

    def _config(self, prod: _Producer, role: str, t: int) -> None:
        deferred = role == "decode" and self.v.deferred_release
        extra: dict = {"release_timeout_ns": 60_000_000_000} if role == "decode" and self.v.release_timeout else {}
        prod.add(
            "node_config",
            t,
            pool_tokens=self.m * PAGE_TOKENS,
            pool_pages=self.m,
            page_size=PAGE_TOKENS,
            context_tokens=2 * (self.m + 1) * PAGE_TOKENS,
            deferred_release=deferred,
            page_tags=role == "decode" and self.v.page_tags,
            config_source="model",
            **extra,
        )

    def _step(self, st: Step, t: int) -> None:
        a, i, b, s2 = st.action, st.request, st.before, st.after
        ref = self._ref(b, i)
        pre, dec, router = self.prods["prefill"], self.prods["decode"], self.prods["router"]
        r, r2 = b.reqs[i], s2.reqs[i]
        prompt = self.prompt_tokens(b, i)
        if a in ("admit", "reject"):
            pre.add("request_received", t, ref, prompt_tokens=prompt)
            if r2[1] and (a == "reject" or r2[NSEND] == 1):
                reason = f"input of {prompt} tokens exceeds the KV pool of {self.m * PAGE_TOKENS} tokens"
                pre.add("request_aborted", t, ref, stage="prefill_queue", abort_reason=reason, http_status=400)
        elif a == "client_abort":
            router.add("request_aborted", t, ref, stage="router", abort_reason="client disconnected", http_status=499)
        elif a == "prefill_abort":
            pre.add("request_aborted", t, ref, stage="prefill", abort_reason="aborted by the client", http_status=499)
            self._freed_prefill(pre, b, s2, i, t, "abort")
        elif a in ("reserve", "decode_refuse"):
            dec.add("request_received", t, ref, prompt_tokens=self.k * PAGE_TOKENS)
            if a == "reserve":
                pages = _ids(r2[DPAGES])
                dec.add("transfer_reserved", t, ref, pages=pages, num_tokens=self.k * PAGE_TOKENS)
                dec.add("pages_allocated", t, ref, pages=pages, purpose="decode_reservation")
            else:
                dec.add(
                    "request_aborted", t, ref, stage="decode_prealloc", abort_reason="pool exhausted", http_status=503
                )
        elif a == "forward":
            self._forward(pre, b, s2, i, t, ref)
        elif a == "prefill_exhausted":
            pre.add("request_aborted", t, ref, stage="prefill_forward", abort_reason="pool exhausted", http_status=503)
        elif a == "post":
            chunks = list(b_arg_chunks(st))
            last = max(chunks) == r[NSEND] - 1
            pre.add(
                "transfer_sent",
                t,
                ref,
                pages=_ids(r[PPAGES][c] for c in chunks),
                dst_pages=_ids(r[DPAGES][c] for c in chunks),
                num_tokens=len(chunks) * PAGE_TOKENS,
                is_last_chunk=last,
            )
        elif a == "land":
            c = st.arg
            assert isinstance(c, int)
            dec.add(
                "kv_written",
                t,
                ref,
                pages=_ids([r[DPAGES][c]]),
                token_start=c * PAGE_TOKENS,
                token_end=(c + 1) * PAGE_TOKENS,
                source="transfer_in",
            )
        elif a == "notify":
            self._freed_prefill(pre, b, s2, i, t, "finish")
        elif a == "transfer_fail":
            pre.add("request_aborted", t, ref, stage="transfer", abort_reason="transfer failed", http_status=500)
            self._freed_prefill(pre, b, s2, i, t, "abort")
        elif a in ("commit", "commit_refused"):
            landed = _ids(r[DPAGES][: r[NSEND]])
            # without the length check decode cannot see a short transfer: it takes it as complete
            status = "mismatch" if a == "commit_refused" else "ok"
            dec.add("transfer_received", t, ref, pages=landed, num_tokens=r[NSEND] * PAGE_TOKENS, status=status)
            if a == "commit_refused":
                dec.add(
                    "request_aborted", t, ref, stage="decode", abort_reason="transfer length mismatch", http_status=500
                )
        elif a == "read":
            dec.add("kv_read", t, ref, pages=_ids(r[DPAGES]))
        elif a == "tag_refused":
            dec.add("request_aborted", t, ref, stage="decode", abort_reason="page tag mismatch", http_status=500)
        elif a == "decode_abort":
            dec.add("request_aborted", t, ref, stage="decode", abort_reason="aborted by the client", http_status=499)
        elif a == "fail_received":
            dec.add("transfer_received", t, ref, pages=[], num_tokens=0, status="failed")
            dec.add("request_aborted", t, ref, stage="transfer", abort_reason="transfer failed", http_status=500)
        self._freed_decode(dec, b, s2, i, t, a)
        if r[RESP] == R_NONE and r2[RESP] != R_NONE:
            ok = r2[RESP] == R_OK
            router.add(
                "response_sent",
                t,
                ref,
                http_status=200 if ok else ERROR_STATUS.get(a, 500),
                prompt_tokens=prompt,
                completion_tokens=COMPLETION_TOKENS if ok else 0,
                latency_ns=t - T0_NS,
                finish_reason="length" if ok else "abort",
            )

    def _forward(self, pre: _Producer, b: State, s2: State, i: int, t: int, ref: dict) -> None:
        r2 = s2.reqs[i]
        evicted = [p for p in range(self.m) if b.ppool[p][1] >= 0 and s2.ppool[p] == (0, -1, b.ppool[p][2])]
        if evicted:
            pre.add("pages_freed", t, None, pages=_ids(evicted), free_reason="eviction")
        pages = _ids(r2[PPAGES])
        hashes = [_block_hash(s2, i, n) for n in range(len(pages))]
        if r2[11]:  # HIT: the first page is the tenant's cached prefix
            pre.add("pages_allocated", t, ref, pages=pages[:1], purpose="prefix_hit", block_hashes=hashes[:1])
            own, own_hashes, start = pages[1:], hashes[1:], PAGE_TOKENS
        else:
            own, own_hashes, start = pages, hashes, 0
        if own:
            pre.add("pages_allocated", t, ref, pages=own, purpose="prefill_extend")
            pre.add(
                "kv_written",
                t,
                ref,
                pages=own,
                token_start=start,
                token_end=start + len(own) * PAGE_TOKENS,
                source="forward",
                block_hashes=own_hashes,
            )
        pre.add("kv_read", t, ref, pages=pages)

    def _freed_prefill(self, pre: _Producer, b: State, s2: State, i: int, t: int, reason: str) -> None:
        pages = _ids(b.reqs[i][PPAGES])
        if pages:
            pre.add("pages_freed", t, self._ref(b, i), pages=pages, free_reason=reason)

    def _freed_decode(self, dec: _Producer, b: State, s2: State, i: int, t: int, action: str) -> None:
        freed = [p for p in b.reqs[i][DPAGES] if b.dpool[p][0] == i and s2.dpool[p][0] != i]
        if freed:
            reason = {"finish": "finish", "drained": "deferred_release", "release_timeout": "deferred_release"}
            dec.add("pages_freed", t, self._ref(b, i), pages=_ids(freed), free_reason=reason.get(action, "abort"))


def _ids(pages) -> list[int]:
    """Model page p is page id p + 1 in the history (0 is every pool's padding page)."""
    return [p + 1 for p in pages]


def b_arg_chunks(st: Step) -> tuple[int, ...]:
    arg = st.arg
    assert isinstance(arg, tuple), "model: a post step names its chunks"
    return arg


def _block_hash(s: State, i: int, n: int) -> int:
    """Content keys: a tenant's first page is its shared prefix (one key per tenant); the rest are the request's own."""
    if n == 0 and s.reqs[i][LONG] == 0:
        return 1_000 + s.reqs[i][TENANT]
    return 10_000 * (i + 1) + n


def write_history(cx: Counterexample, variant: Variant, bounds, out_dir: Path, index: int) -> list[Path]:
    """The counterexample's events, one JSON-lines file per producer under ``out_dir/<index>-<property>/``."""
    name = f"{index:02d}-{cx.property}"
    folder = out_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    per_node = HistoryWriter(variant, bounds.pages, bounds.chunks, f"{variant.name}-{name}").events(cx.steps)
    paths = []
    for node, events in per_node.items():
        path = folder / f"{node}.jsonl"
        path.write_text("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events))
        paths.append(path)
    return paths
