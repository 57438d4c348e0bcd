"""``ServeConfig``: how ``kvtrail serve`` listens and stops; the command's flags read their defaults here.

Kept apart from the server so the CLI can show the defaults without importing uvicorn or FastAPI.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtrail.service.limits import QueryLimits
from kvtrail.serving.deadlines import ReadTimeouts

BANNER = "kvtrail service listening on {url}"  # the service's first line of stdout
DEFAULT_MAX_BODY_BYTES = 64 * 2**20
# History time (wall clock of the events) after a request's newest event when the live judge forgets it, if no page
# names it (kvtrail serve --judge-horizon-s; docs/service.md, "Memory"): the model's monitors keep the same.
DEFAULT_JUDGE_HORIZON_S = 600
DEFAULT_JUDGE_INTERVAL_S = 0.5  # the live judge's least time between two polls (kvtrail serve --judge-interval-s)
# DuckDB's buffer pool (kvtrail serve --memory-limit-mb): DuckDB's own default is 80 % of the host's RAM; a query
# needing more spills to the store's temporary directory (or fails with an out-of-memory error, HTTP 503).
DEFAULT_MEMORY_LIMIT_MB = 1024


@dataclass(frozen=True)
class ServeConfig:
    """Where the service listens, its largest ingest body, how long a stop waits for requests in flight, and
    the least time between two polls of the live judge while batches stream in (its lag's bound: a shorter
    interval keeps findings fresher, a longer one leaves ingest more CPU, since each poll has fixed
    costs), and where the judge's results go as OpenTelemetry (none by default)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: the OS picks a free port; the banner names it
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_timeout_s: float = 30.0
    judge_interval_s: float = DEFAULT_JUDGE_INTERVAL_S
    otlp_endpoint: str | None = None  # OTLP/HTTP base URL the judge's results are exported to (kvtrail.alerts.otel)
    query_limits: QueryLimits = QueryLimits()  # queries running and waiting per token (429 beyond)
    read_timeouts: ReadTimeouts = ReadTimeouts()  # a request's headers and body must arrive in time (408 past)
    metrics_token: bool = False  # GET /metrics needs an operator or metrics token (it names every node)
    signing_key: str | None = None  # Ed25519 private key (PEM) signing GET /v1/audit/checkpoint's checkpoints
    memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB  # DuckDB's buffer pool (SET memory_limit)
    judge_horizon_s: int = DEFAULT_JUDGE_HORIZON_S  # the live judge forgets a request this long after its last event

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be 0..65535, got {self.port}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: must be >= 1, got {self.max_body_bytes}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s: must be >= 0, got {self.drain_timeout_s}")
        if not 0 <= self.judge_interval_s <= 3600:
            raise ValueError(f"judge_interval_s: must be 0..3600, got {self.judge_interval_s}")
        if not 10 <= self.judge_horizon_s <= 86_400:
            raise ValueError(f"judge_horizon_s: must be 10..86400 (s), got {self.judge_horizon_s}")
        if not 64 <= self.memory_limit_mb <= 2**24:
            raise ValueError(f"memory_limit_mb: must be 64..{2**24} (MB), got {self.memory_limit_mb}")
        if self.otlp_endpoint is not None:
            from kvtrail.alerts.otel import check_endpoint

            check_endpoint(self.otlp_endpoint)
