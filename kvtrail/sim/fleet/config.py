"""The fleet trace simulator's configuration: :class:`FleetConfig` is the one source of truth for every
knob (the ``kvtrail simulate`` flags read their defaults from it), plus the bug class names.

Running a configuration is :mod:`kvtrail.sim.fleet.run`; the simulation itself lives in
:mod:`kvtrail.sim.fleet.loop` (arrivals, router, event loop), :mod:`kvtrail.sim.fleet.prefill` and
:mod:`kvtrail.sim.fleet.decode` (the nodes); the bug classes and the ground truth in
:mod:`kvtrail.sim.fleet.plants`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from kvtrail.timeutil import format_utc

# 2026-09-01T00:00:00Z: a fixed start so that output never depends on the real clock.
DEFAULT_START_NS = 1_788_220_800_000_000_000
# Faults the simulator injects; cross_tenant_prefix is planted by turning cache namespaces off.
FAULT_CLASSES = ("placeholder", "use_after_free", "late_write", "double_alloc")
PLANT_CLASSES = FAULT_CLASSES + ("cross_tenant_prefix",)


@dataclass(frozen=True)
class FleetConfig:
    """Every knob of a simulated fleet. Times carry their unit in the name; pools are in tokens."""

    seed: int = 0
    cluster: str = "fleet-sim"
    start_ns: int = DEFAULT_START_NS
    hours: float = 1.0  # arrivals stop after this much simulated time (ignored with target_page_events)
    rate_per_s: float = 2.0  # Poisson request arrivals, whole fleet
    target_page_events: int = 0  # > 0: stop arrivals once this many page-events were emitted
    # nodes
    prefill_nodes: int = 4
    decode_nodes: int = 4
    vulnerable_prefill_nodes: int = 1  # the first N prefill nodes run the pre-0.5.20 engine (placeholder bug)
    page_size: int = 16
    prefill_pool_tokens: int = 681_280  # every prefill node's pool (the incident's)
    decode_pool_tokens: int = 2_097_152
    context_tokens: int = 1_048_576  # advertised by every node and enforced by the router
    chunk_tokens: int = 8_192  # prefill token budget per forward step (chunked prefill)
    prefill_rate_min_tokens_per_s: float = 20_000.0  # each prefill node's rate is drawn from this range
    prefill_rate_max_tokens_per_s: float = 60_000.0
    decode_step_ms: float = 30.0  # one generated token per running request per step
    transfer_us_per_page: float = 10.0  # KV transfer time per page (plus one hop)
    hop_us: float = 200.0  # one network hop (router <-> nodes, transfer acks)
    # traffic
    tenants: int = 20  # tenant k sends with weight 1/(k+1)
    prompt_median_tokens: int = 8_192  # lognormal prompt lengths ...
    prompt_sigma: float = 1.7  # ... with a heavy tail (some beyond the prefill pool and the context)
    min_prompt_tokens: int = 16
    completion_median_tokens: int = 256  # lognormal, capped by the request's max_new_tokens
    completion_sigma: float = 1.0
    max_new_tokens: int = 4_096
    client_abort_prob: float = 0.02  # clients that disconnect during generation (legitimate 499s)
    # prefix cache
    prefix_share_prob: float = 0.5  # prompts that start with a shared document / system prompt
    public_doc_prob: float = 0.02  # ... of those: a document every tenant uses (the rest: the tenant's own)
    docs_per_tenant: int = 8
    public_docs: int = 4
    doc_median_tokens: int = 2_048
    cache_namespaces: bool = True  # prefix-cache namespace per tenant; False plants cross_tenant_prefix
    cache_max_fraction: float = 0.5  # radix cache keeps at most this share of a prefill pool
    # planted bugs
    bugs: tuple[str, ...] = FAULT_CLASSES
    plants_per_hour: float = 4.0  # arming rate of each of use_after_free, late_write, double_alloc
    # output batching
    events_per_batch: int = 50_000  # per producer
    max_pages_per_batch: int = 4_000_000  # page entries per producer batch (bounds memory)

    def __post_init__(self) -> None:
        _positive(
            self,
            "hours",
            "rate_per_s",
            "prefill_nodes",
            "decode_nodes",
            "page_size",
            "prefill_pool_tokens",
            "decode_pool_tokens",
            "context_tokens",
            "chunk_tokens",
            "prefill_rate_min_tokens_per_s",
            "decode_step_ms",
            "tenants",
            "prompt_median_tokens",
            "min_prompt_tokens",
            "completion_median_tokens",
            "max_new_tokens",
            "docs_per_tenant",
            "public_docs",
            "doc_median_tokens",
            "events_per_batch",
            "max_pages_per_batch",
        )
        _non_negative(
            self,
            "target_page_events",
            "vulnerable_prefill_nodes",
            "prompt_sigma",
            "completion_sigma",
            "transfer_us_per_page",
            "hop_us",
            "plants_per_hour",
        )
        for name in ("client_abort_prob", "prefix_share_prob", "public_doc_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}: must be between 0 and 1")
        if not 0.0 < self.cache_max_fraction <= 1.0:
            raise ValueError("cache_max_fraction: must be in (0, 1]")
        if not self.cluster:
            raise ValueError("cluster: must be a non-empty string")
        if self.vulnerable_prefill_nodes > self.prefill_nodes:
            raise ValueError("vulnerable_prefill_nodes: more than prefill_nodes")
        if self.prefill_rate_max_tokens_per_s < self.prefill_rate_min_tokens_per_s:
            raise ValueError("prefill_rate_max_tokens_per_s: below prefill_rate_min_tokens_per_s")
        if self.chunk_tokens % self.page_size:
            raise ValueError("chunk_tokens: must be a multiple of page_size")
        if self.prefill_pool_tokens < self.page_size or self.prefill_pool_tokens < self.chunk_tokens:
            raise ValueError("prefill_pool_tokens: must hold at least one chunk (chunk_tokens)")
        if self.decode_pool_tokens < self.context_tokens + self.max_new_tokens + self.page_size:
            # A request of the full context must fit on a decode node with its whole generation.
            raise ValueError("decode_pool_tokens: must be at least context_tokens + max_new_tokens + page_size")
        if not isinstance(self.bugs, tuple):
            raise ValueError("bugs: must be a tuple of bug class names")
        for name in self.bugs:
            if name not in FAULT_CLASSES:
                hint = " (planted by cache_namespaces=False)" if name == "cross_tenant_prefix" else ""
                raise ValueError(f"bugs: {name!r} is not one of {', '.join(FAULT_CLASSES)}{hint}")

    @property
    def end_ns(self) -> int:
        """When arrivals stop (without target_page_events)."""
        return self.start_ns + int(self.hours * 3600e9)

    @property
    def instance(self) -> str:
        """The producers' ``instance``: one per run (start and seed), so runs of one cluster stay apart."""
        return f"{format_utc(self.start_ns)}-s{self.seed}"


def _positive(cfg: FleetConfig, *names: str) -> None:
    for name in names:
        if not getattr(cfg, name) > 0:
            raise ValueError(f"{name}: must be > 0, got {getattr(cfg, name)!r}")


def _non_negative(cfg: FleetConfig, *names: str) -> None:
    for name in names:
        if not getattr(cfg, name) >= 0:
            raise ValueError(f"{name}: must be >= 0, got {getattr(cfg, name)!r}")


def config_defaults() -> dict:
    """Field name -> default value (the CLI's defaults)."""
    return {f.name: f.default for f in fields(FleetConfig)}


def config_json(config: FleetConfig) -> dict:
    """The config as JSON-ready values (tuples as lists)."""
    out = asdict(config)
    out["bugs"] = list(config.bugs)
    return out
