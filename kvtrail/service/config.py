"""``ServeConfig``: how ``kvtrail serve`` listens and stops; the command's flags read their defaults here.

Kept apart from the server so the CLI can show the defaults without importing uvicorn or FastAPI.
"""

from __future__ import annotations

from dataclasses import dataclass

BANNER = "kvtrail service listening on {url}"  # the service's first line of stdout
DEFAULT_MAX_BODY_BYTES = 64 * 2**20


@dataclass(frozen=True)
class ServeConfig:
    """Where the service listens, its largest ingest body, and how long a stop waits for requests in flight."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: the OS picks a free port; the banner names it
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be 0..65535, got {self.port}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes: must be >= 1, got {self.max_body_bytes}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s: must be >= 0, got {self.drain_timeout_s}")
