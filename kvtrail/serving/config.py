"""Configuration of the reference PD serving stack: one frozen dataclass is the source of truth.

``StackConfig.incident()`` is the incident's shape, scaled to a CPU: the prefill pool holds fewer
tokens than the context the router advertises, and the engine behaves like SGLang before 0.5.20.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvtrail.audit.recorder import RecorderConfig
from kvtrail.serving.allocator import REUSE_POLICIES
from kvtrail.serving.deadlines import ReadTimeouts

MODES = ("vulnerable", "patched")


@dataclass(frozen=True)
class Faults:
    """Fault injections for the wider bug class; all off by default.

    - ``premature_free``: decode frees a request's pages right after they land, while the request
      still reads them (use-after-free: the next admission reuses them).
    - ``late_write``: prefill holds back the transfer of a request the client flags (header
      ``x-kvtrail-abort-after-ms``) and the router aborts that request while it is in flight. In
      ``vulnerable`` mode decode frees the pages at once and the write lands later in pages another
      request may own; ``patched`` mode's deferred release keeps them until the write is done.
    - ``double_alloc``: decode's allocator hands one page still held by a running request to the next
      request as well.
    - ``corrupt_transfer``: one byte of the first page that lands on decode is flipped (corruption in
      flight), which the per-page digests localise.
    """

    premature_free: bool = False
    late_write: bool = False
    double_alloc: bool = False
    corrupt_transfer: bool = False


@dataclass(frozen=True)
class StackConfig:
    """Everything the router and both workers need; sent to the worker processes at start."""

    mode: str = "patched"
    page_size: int = 16
    prefill_pool_tokens: int = 64 * 1024
    decode_pool_tokens: int = 128 * 1024
    context_tokens: int = 32 * 1024
    max_new_tokens: int = 64
    reuse: str = "lowest"
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 32
    max_running_requests: int = 64
    transfer_timeout_s: float = 30.0
    decode_step_delay_s: float = 0.0  # simulated compute time of one decode step (widens race windows)
    audit: bool = True  # False: every process records nothing (the baseline for overhead benchmarks)
    # Per-page KV digests on both roles (prefill records what it sends, decode compares what landed).
    # Page ownership tags are checked before every attention read in patched mode.
    kv_digests: bool = True
    # Each commit is a DuckDB transaction (~5-30 ms, mostly fixed cost) in the store process, shared
    # by three producers, and each flush costs its producer a batch build: drain once a second rather
    # than every 20 ms (flush() is still immediate). That interval is also the most a killed process
    # can lose of each producer's newest events (an unclean end, which `kvtrail audit verify` reports
    # with this bound).
    recorder: RecorderConfig = field(default_factory=lambda: RecorderConfig(flush_interval_s=1.0))
    # On stop (SIGINT or SIGTERM): how long the router waits for requests in flight before it closes them.
    drain_timeout_s: float = 30.0
    # How long a client has to send the router a request's headers, and its body (408 and closed past them).
    read_timeouts: ReadTimeouts = ReadTimeouts()
    cluster: str = "reference"
    api_keys: tuple[tuple[str, str], ...] = (("key-acme", "acme"), ("key-globex", "globex"), ("key-initech", "initech"))
    faults: Faults = field(default_factory=Faults)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"stack config 'mode': {self.mode!r} is not one of {', '.join(MODES)}")
        if self.reuse not in REUSE_POLICIES:
            raise ValueError(f"stack config 'reuse': {self.reuse!r} is not one of {', '.join(REUSE_POLICIES)}")
        for name in (
            "page_size",
            "prefill_pool_tokens",
            "decode_pool_tokens",
            "context_tokens",
            "max_new_tokens",
            "num_layers",
            "num_heads",
            "head_dim",
            "max_running_requests",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"stack config '{name}': must be >= 1")
        if not self.drain_timeout_s >= 0:
            raise ValueError("stack config 'drain_timeout_s': must be >= 0")
        for name in ("prefill_pool_tokens", "decode_pool_tokens"):
            if getattr(self, name) % self.page_size:
                raise ValueError(f"stack config '{name}': must be a multiple of page_size ({self.page_size})")

    @property
    def page_tags(self) -> bool:
        return self.mode == "patched"

    @property
    def prefill_pages(self) -> int:
        return self.prefill_pool_tokens // self.page_size

    @property
    def decode_pages(self) -> int:
        return self.decode_pool_tokens // self.page_size

    @property
    def tenants(self) -> dict[str, str]:
        """API key -> tenant."""
        return dict(self.api_keys)

    @classmethod
    def incident(cls, **changes) -> "StackConfig":
        """Prefill pool smaller than the advertised context, SGLang < 0.5.20 behaviour."""
        base = cls(
            mode="vulnerable", prefill_pool_tokens=8 * 1024, decode_pool_tokens=64 * 1024, context_tokens=16 * 1024
        )
        return replace(base, **changes)
