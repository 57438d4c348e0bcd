"""What the deployment allows and how strict the judgement is: the knobs every findings engine reads.

Two findings depend on policy rather than on the record alone. F10 (cross-tenant prefix sharing) is a
finding only where tenants must not share prefix-cache pages (no cache salt or namespace per tenant);
F9 (implausible latency) compares a response's time to first token with the prefill rate its prefill
node measurably achieves, with a safety factor so that a busy node's slower samples do not flag fast,
legitimate requests.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForensicsPolicy:
    """Policy and thresholds shared by the replay and SQL engines (they must agree on them)."""

    # Tenants may share prefix-cache pages (no F10) only when the deployment's policy says so.
    allow_tenant_cache_sharing: bool = False
    # F9: a node's prefill rate is this quantile of its forward chunks' rates (tokens written / time
    # since the later of the request's arrival at the node and the node's previous forward write),
    # requests the node aborted left out ...
    latency_quantile: float = 0.9
    # ... and a response is implausible when its TTFT is below (tokens to prefill) / rate / factor.
    latency_factor: float = 2.0
    # Fewer clean samples than this on a node: its rate is unknown and F9 is not judged there.
    min_latency_samples: int = 3

    def __post_init__(self):
        if not 0.0 < self.latency_quantile <= 1.0:
            raise ValueError("latency_quantile: must be in (0, 1]")
        if self.latency_factor < 1.0:
            raise ValueError("latency_factor: must be >= 1")
        if self.min_latency_samples < 1:
            raise ValueError("min_latency_samples: must be >= 1")
