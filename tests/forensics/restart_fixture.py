"""A hand-built store whose every word about tenants is known: a same-tenant read, a read of never-written
pages only, a read of another tenant's data, and a restart of both nodes inside the window.

prefill-0 and decode-0 run as instance i1 (the incident's engine: a prompt longer than the 128-token prefill
pool is rejected yet decode reads every page it reserved), then restart as instance i2 with the same pools
and a patched engine (an over-long prompt gets HTTP 400, nothing is transferred). Decode's pool is 1,024
tokens in both instances: a figure summed over the instances would say 2,048.

Requests (``<tenant>-<n>``), all in the window W0 .. W0 + 1 h:
  i1  initech-1  over-long: reads decode pages 2..13, never written         -> only stale memory
      acme-2     short: writes decode pages 1..7                           -> not affected
      acme-3     over-long: reads pages 2..7 (acme-2's) and 8..13 (never)   -> same tenant only
      globex-4   over-long: reads pages 2..7 (acme-2's) and 8..13 (never)   -> another customer's data
  i2  acme-5     over-long: rejected, HTTP 400                             -> not affected
      globex-6   short                                                     -> not affected
So prefill-0 served 4 requests as i1 (3 affected) and 2 as i2 (none): 3 of 6 in all.
"""

from __future__ import annotations

from kvtrail.audit.batch import from_dicts
from kvtrail.audit.store import AuditStore
from tests.conftest import producer
from tests.forensics.incident_fixture import MIN, PAGE, PREFILL_POOL_TOKENS, W0, Incident

W1 = W0 + 60 * MIN
WINDOW = ["--from", "2026-09-09T00:00:00Z", "--to", "2026-09-09T01:00:00Z"]
DECODE_POOL_TOKENS = 64 * PAGE
LONG, SHORT = 200, 100
PLAN = [(1, "initech", LONG), (2, "acme", SHORT), (3, "acme", LONG), (4, "globex", LONG)]
AFTER_RESTART = [(30, "acme", LONG), (31, "globex", SHORT)]
TRUTH = {"initech-1": "never_written", "acme-3": "same_tenant", "globex-4": "other_tenants"}


class Restarted(Incident):
    """The incident's producers, restartable as a new instance whose engine rejects an over-long prompt."""

    patched = False

    def restart(self, instance: str) -> None:
        self.prods = {
            "router": self.prods["router"],
            "p": producer("prefill-0", "prefill", instance),
            "d": producer("decode-0", "decode", instance),
        }
        self.seqs.update(p=0, d=0)
        self.patched = True
        self.add("p", "node_config", pool_tokens=PREFILL_POOL_TOKENS, pool_pages=8, page_size=PAGE, context_tokens=512)
        self.add("d", "node_config", pool_tokens=DECODE_POOL_TOKENS, pool_pages=64, page_size=PAGE, context_tokens=512)

    def request(self, minute: float, tenant: str, prompt_tokens: int, key: str | None = None) -> str:
        if not (self.patched and prompt_tokens > PREFILL_POOL_TOKENS):
            return super().request(minute, tenant, prompt_tokens, key)
        self.n += 1
        rid = f"{tenant}-{self.n}"
        self.now = max(self.now, W0 + int(minute * MIN))
        req = {"request_id": rid, "transfer_id": 1000 + self.n, "tenant_id": tenant, "api_key_id": f"k:{tenant}"}
        self.add("router", "request_received", req, prompt_tokens=prompt_tokens, max_new_tokens=8)
        self.add("p", "request_received", req, prompt_tokens=prompt_tokens)
        self.add(
            "p",
            "request_aborted",
            req,
            stage="prefill_queue",
            abort_reason="input too long",
            http_status=400,
            prompt_tokens=prompt_tokens,
        )
        self.add(
            "router",
            "response_sent",
            req,
            http_status=400,
            prompt_tokens=prompt_tokens,
            completion_tokens=0,
            latency_ns=1_000_000,
        )
        return rid


def build_restarted(path) -> Restarted:
    """Write the store at ``path``."""
    inc = Restarted()
    for minute, tenant, tokens in PLAN:
        inc.request(minute, tenant, tokens)
    inc.now = W0 + 20 * MIN
    inc.restart("i2")
    for minute, tenant, tokens in AFTER_RESTART:
        inc.request(minute, tenant, tokens)
    with AuditStore(path) as store:
        store.append(from_dicts(inc.events))
    return inc
