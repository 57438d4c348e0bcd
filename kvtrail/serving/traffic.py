"""Multi-tenant client traffic for the reference stack, with per-tenant canaries as ground truth.

Each tenant's prompts repeat a canary string unique to that tenant, so any response that carries
another tenant's canary has, by content alone, read that tenant's data.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass

import httpx
import numpy as np

CANARY_RE = re.compile(r"CANARY-([a-z]+)-([0-9a-f]{4})")


@dataclass(frozen=True)
class TrafficConfig:
    """How much traffic, how long the prompts, what share is longer than the prefill pool."""

    num_requests: int = 60
    concurrency: int = 4
    min_prompt_tokens: int = 400
    max_prompt_tokens: int = 3000
    overlong_share: float = 0.15
    overlong_tokens: tuple[int, int] = (9000, 14000)
    max_tokens: int = 48
    seed: int = 0


@dataclass(frozen=True)
class Outcome:
    tenant: str
    prompt_tokens: int
    overlong: bool
    status: int
    text: str
    latency_s: float
    completion_tokens: int

    @property
    def foreign_canaries(self) -> list[str]:
        """Tenants whose canary appears in this response though they did not send the prompt."""
        # A splice of two pages can yield a canary-shaped string; only a whole, valid canary counts.
        found = {m.group(1) for m in CANARY_RE.finditer(self.text) if m.group(0) == canary(m.group(1))}
        return sorted(found - {self.tenant})


def canary(tenant: str) -> str:
    code = format(sum(map(ord, tenant)) * 2654435761 % 65536, "04x")
    return f"CANARY-{tenant}-{code}"


def make_prompt(tenant: str, n: int) -> str:
    return (f"[{canary(tenant)}] note " * (n // 20 + 1))[:n]


def plan(cfg: TrafficConfig, tenants: list[str]) -> list[tuple[str, int, bool]]:
    """(tenant, prompt length, is over-long) for every request, deterministic for a seed."""
    rng = np.random.default_rng(cfg.seed)
    out = []
    for _ in range(cfg.num_requests):
        tenant = tenants[int(rng.integers(len(tenants)))]
        overlong = bool(rng.random() < cfg.overlong_share)
        lo, hi = cfg.overlong_tokens if overlong else (cfg.min_prompt_tokens, cfg.max_prompt_tokens)
        out.append((tenant, int(rng.integers(lo, hi + 1)), overlong))
    return out


async def _run(url: str, keys: dict[str, str], cfg: TrafficConfig, progress) -> list[Outcome]:
    requests = plan(cfg, sorted(keys))
    sem = asyncio.Semaphore(cfg.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def one(tenant: str, n: int, overlong: bool) -> Outcome:
            async with sem:
                t0 = time.perf_counter()
                r = await client.post(
                    "/v1/completions",
                    json={"prompt": make_prompt(tenant, n), "max_tokens": cfg.max_tokens},
                    headers={"Authorization": f"Bearer {keys[tenant]}"},
                )
                body = r.json()
                text = body["choices"][0]["text"] if r.status_code == 200 else ""
                usage = body.get("usage", {})
                if progress:
                    progress(1)
                return Outcome(
                    tenant,
                    n,
                    overlong,
                    r.status_code,
                    text,
                    time.perf_counter() - t0,
                    usage.get("completion_tokens", 0),
                )

        return await asyncio.gather(*(one(*req) for req in requests))


def run_traffic(url: str, keys: dict[str, str], cfg: TrafficConfig, progress=None) -> list[Outcome]:
    """Send the planned requests (``keys``: tenant -> API key) and return what each client saw."""
    return asyncio.run(_run(url, keys, cfg, progress))
