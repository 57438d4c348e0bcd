"""A small hand-built incident across a router, one prefill and one decode node, for analysis and report tests.

The prefill pool holds 128 tokens while the deployment advertises 512 (F8). A prompt longer than the
pool is rejected on prefill (F4) yet decode reserves pages for its full length, receives one page
(F2) and reads the rest: pages acme and umbrella wrote (F1 with victims) and pages nobody wrote.

Window: W0 .. W0 + 6 h; baseline: the 6 h before. Recipients in the window:
  globex       4 over-long prompts, the same as in its baseline       -> consistent
  mallory      6 over-long prompts within 6 minutes                     -> stands out (repeated probing)
  hooli        3 over-long prompts, none before (short ones only)       -> stands out (volume)
  internal-qa  2 over-long prompts                                      -> excluded tenant
  initech      5 over-long prompts with the researcher's key            -> excluded api key
"""

from __future__ import annotations

from kvtrail.audit.batch import from_dicts
from kvtrail.audit.store import AuditStore
from tests.conftest import event, producer

MIN = 60_000_000_000
W0 = 1_788_912_000_000_000_000  # 2026-09-09T00:00:00Z
W1 = W0 + 360 * MIN
PAGE = 16
PREFILL_POOL_TOKENS = 8 * PAGE
LONG, SHORT_ACME, SHORT = 200, 100, 40
RESEARCHER_KEY = "k:researcher"

BASELINE = [
    (-350, "acme", SHORT_ACME),
    (-340, "globex", LONG),
    (-300, "hooli", SHORT),
    (-240, "globex", LONG),
    (-230, "acme", SHORT_ACME),
    (-200, "hooli", SHORT),
    (-140, "globex", LONG),
    (-110, "acme", SHORT_ACME),
    (-40, "globex", LONG),
]
LONG_IN_WINDOW = (
    [(m, "globex") for m in (10, 100, 190, 280)]
    + [(30 + i, "mallory") for i in range(6)]
    + [(m, "hooli") for m in (60, 150, 240)]
    + [(120, "internal-qa"), (121, "internal-qa")]
    + [(200 + i, "initech") for i in range(5)]
)


class Incident:
    """Events of three producers on one clock; ``request()`` adds one request's whole history."""

    def __init__(self, gap: bool = False):
        self.prods = {
            "router": producer("router-0", "router"),
            "p": producer("prefill-0", "prefill"),
            "d": producer("decode-0", "decode"),
        }
        self.seqs = {k: 0 for k in self.prods}
        self.events: list[dict] = []
        self.gap = gap
        self.n = 0
        self.now = W0 - 400 * MIN
        self.add("p", "node_config", pool_tokens=PREFILL_POOL_TOKENS, pool_pages=8, page_size=PAGE, context_tokens=512)
        self.add("d", "node_config", pool_tokens=64 * PAGE, pool_pages=64, page_size=PAGE, context_tokens=512)

    def add(self, node, kind, req=None, **payload):
        e = event(self.seqs[node], kind, self.prods[node], wall_ns=self.now, request=req, **payload)
        self.seqs[node] += 1
        self.now += 1000
        self.events.append(e)
        return e

    def request(self, minute: float, tenant: str, prompt_tokens: int, key: str | None = None) -> str:
        """One request at W0 + minute: router -> prefill -> decode -> response."""
        self.n += 1
        rid = f"{tenant}-{self.n}"
        self.now = max(self.now, W0 + int(minute * MIN))
        req = {"request_id": rid, "transfer_id": 1000 + self.n, "tenant_id": tenant, "api_key_id": key or f"k:{tenant}"}
        pages = -(-prompt_tokens // PAGE)
        dst = list(range(1, pages + 1))
        self.add("router", "request_received", req, prompt_tokens=prompt_tokens, max_new_tokens=8)
        self.add("p", "request_received", req, prompt_tokens=prompt_tokens)
        too_long = prompt_tokens > PREFILL_POOL_TOKENS
        if too_long:  # the engine bug: rejected, input replaced by a one-token placeholder, still sent
            self.add(
                "p",
                "request_aborted",
                req,
                stage="prefill_queue",
                abort_reason="input too long",
                http_status=400,
                prompt_tokens=prompt_tokens,
            )
        self.add("d", "request_received", req, prompt_tokens=prompt_tokens, max_new_tokens=8)
        self.add("d", "transfer_reserved", req, pages=dst, num_tokens=prompt_tokens)
        self.add("d", "pages_allocated", req, pages=dst, purpose="decode_reservation")
        src = [1] if too_long else list(range(1, pages + 1))
        sent_tokens = 1 if too_long else prompt_tokens
        self.add("p", "pages_allocated", req, pages=src, purpose="prefill_extend")
        self.add("p", "kv_written", req, pages=src, token_start=0, token_end=sent_tokens, source="forward")
        self.add(
            "p",
            "transfer_sent",
            req,
            pages=src,
            dst_pages=dst[: len(src)],
            num_tokens=sent_tokens,
            is_last_chunk=True,
            digest=7,
            digest_algo="adler32",
        )
        self.add("p", "pages_freed", req, pages=src, free_reason="finish")
        self.add(
            "d", "kv_written", req, pages=dst[: len(src)], token_start=0, token_end=sent_tokens, source="transfer_in"
        )
        self.add(
            "d",
            "transfer_received",
            req,
            pages=dst[: len(src)],
            num_tokens=sent_tokens,
            status="ok",
            digest=7,
            digest_algo="adler32",
        )
        self.add("d", "kv_read", req, pages=dst)
        self.add("d", "pages_freed", req, pages=dst, free_reason="finish")
        if self.gap and self.n == 3:
            self.seqs["router"] += 5  # five router events never reach the store, and nothing reports them
        self.add(
            "router",
            "response_sent",
            req,
            http_status=200,
            prompt_tokens=prompt_tokens,
            completion_tokens=8,
            latency_ns=5_000_000,
        )
        return rid


def build(path, gap: bool = False) -> Incident:
    """Write the incident into a new store at ``path``."""
    inc = Incident(gap)
    for minute, tenant, tokens in BASELINE:
        inc.request(minute, tenant, tokens)
    last_long = None
    for minute, tenant in sorted(LONG_IN_WINDOW):
        if last_long is None or minute - last_long > 3:  # fresh victim data before each burst
            inc.request(minute - 3, "acme", SHORT_ACME)
            inc.request(minute - 2, "umbrella", SHORT)
        inc.request(minute, tenant, LONG, RESEARCHER_KEY if tenant == "initech" else None)
        last_long = minute
    inc.request(210, "initech", SHORT, "k:initech-prod")
    with AuditStore(path) as store:
        store.append(from_dicts(inc.events))
    return inc


def append_request(path, minute: float, tenant: str, prompt_tokens: int, inc: Incident) -> None:
    """Commit one more request (a new batch per producer) to an existing store built from ``inc``."""
    start = len(inc.events)
    inc.request(minute, tenant, prompt_tokens)
    with AuditStore(path) as store:
        store.append(from_dicts(inc.events[start:]))
