"""PluginConfig: the SGLang plugin's settings, read once from kvtrail's environment variables."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Mapping

ENV_URL = "KVTRAIL_URL"  # a kvtrail service (`kvtrail serve`); the producer token comes from KVTRAIL_TOKEN
ENV_DB = "KVTRAIL_DB"  # or a local store file (one recording process per file: DuckDB has one writer)
ENV_NODE = "KVTRAIL_NODE"
ENV_CLUSTER = "KVTRAIL_CLUSTER"
ENV_ENFORCE = "KVTRAIL_SGLANG_ENFORCE_LENGTH"
ENV_FLUSH = "KVTRAIL_FLUSH_INTERVAL_S"


@dataclass(frozen=True)
class PluginConfig:
    """Where the plugin records and as whom. ``sink`` is a service URL or a store path."""

    sink: str
    node: str
    cluster: str
    enforce_length: bool = False  # the transferred-length check at decode commit (both roles must run it)
    flush_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.sink:
            raise ValueError(f"sglang plugin config 'sink': set {ENV_URL} (with KVTRAIL_TOKEN) or {ENV_DB}")
        if not self.node or not self.cluster:
            raise ValueError("sglang plugin config 'node'/'cluster': must be non-empty")
        if not self.flush_interval_s > 0:
            raise ValueError(f"sglang plugin config 'flush_interval_s' ({ENV_FLUSH}): must be > 0")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PluginConfig | None:
        """The configuration the environment asks for, or None when neither a URL nor a store is set (plugin off)."""
        env = os.environ if env is None else env
        url, db = env.get(ENV_URL, ""), env.get(ENV_DB, "")
        if url and db:
            raise ValueError(f"sglang plugin config: set only one of {ENV_URL} and {ENV_DB}")
        if not (url or db):
            return None
        if url and not url.startswith(("http://", "https://")):
            raise ValueError(f"sglang plugin config '{ENV_URL}': {url!r} is not an http:// or https:// URL")
        enforce = env.get(ENV_ENFORCE, "0").strip().lower()
        if enforce not in ("0", "1", "false", "true", ""):
            raise ValueError(f"sglang plugin config '{ENV_ENFORCE}': {enforce!r} is not 0 or 1")
        try:
            flush = float(env.get(ENV_FLUSH, "1.0"))
        except ValueError:
            raise ValueError(f"sglang plugin config '{ENV_FLUSH}': not a number") from None
        return cls(
            sink=url or db,
            node=env.get(ENV_NODE) or socket.gethostname(),
            cluster=env.get(ENV_CLUSTER) or "default",
            enforce_length=enforce in ("1", "true"),
            flush_interval_s=flush,
        )
