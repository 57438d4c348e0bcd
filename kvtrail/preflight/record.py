"""Recording what preflight read as ``node_config`` events through a recorder's sink: into a store
(``--db``) or a running service (``--url``/``--token``, a producer token; :class:`HttpSink`), one producer
instance per node, so the audit holds the configuration a deployment was checked with
(``config_source``: where the values came from)."""

from __future__ import annotations

import re
import time
from pathlib import Path

from kvtrail.audit.batch import from_dicts
from kvtrail.audit.contract import Sink
from kvtrail.audit.httpsink import HttpSink, HttpSinkConfig
from kvtrail.audit.store import AuditStore
from kvtrail.errors import KvtrailError, StoreError, ValidationError
from kvtrail.preflight.node import NodeConfig

CLUSTER = "preflight"
TIMEOUT_S = 30.0


def node_name(node: NodeConfig) -> str:
    """The node's name in the store: the name given with --node, else the source's file stem or host:port;
    and its DP rank."""
    if node.node:
        base = node.node
    elif node.source.startswith(("http://", "https://")):
        base = re.sub(r"^https?://", "", node.source).split("/")[0]
    else:
        base = Path(node.source).stem
    dp = re.search(r"\bDP\d+\b", node.rank or "")
    return f"{base}-{dp.group(0).lower()}" if dp else base


def events_of(nodes: list[NodeConfig], now_ns: int | None = None) -> tuple[list[dict], list[str]]:
    """(one node_config event per recordable node, why each other node was not recorded)."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    events, skipped = [], []
    for node in nodes:
        missing = [f for f in ("role", "pool_tokens", "context_tokens", "page_size") if getattr(node, f) is None]
        if missing:
            skipped.append(
                f"{node.source} {node.rank or ''}: not recorded, {', '.join(missing)} unknown".replace("  ", " ")
            )
            continue
        assert node.pool_tokens is not None and node.page_size is not None
        producer = {
            "cluster": CLUSTER,
            "node": node_name(node),
            "role": node.role,
            "engine": "sglang",
            "engine_version": node.version or "unknown",
            "instance": f"preflight-{now_ns}",
        }
        payload = {
            k: getattr(node, k)
            for k in (
                "max_running_requests",
                "checksum_enabled",
                "canary_enabled",
                "deferred_release",
                "release_timeout_ns",
                "transfer_batch_max_pages",
            )
            if getattr(node, k) is not None
        }
        events.append(
            {
                "schema_version": 1,
                "producer": producer,
                "seq": 0,
                "wall_ns": now_ns,
                "mono_ns": 0,
                "kind": "node_config",
                "pool_tokens": node.pool_tokens,
                "pool_pages": node.pool_tokens // node.page_size,
                "page_size": node.page_size,
                "context_tokens": node.context_tokens,
                "config_source": node.config_source,
                **payload,
            }
        )
    return events, skipped


def record(sink: Sink, events: list[dict]) -> None:
    """Commit ``events`` through a recorder's sink (one producer per batch), as a recorder's writer would:
    a store (:class:`~kvtrail.audit.store.AuditStore`) or a service (:class:`~kvtrail.audit.httpsink.HttpSink`)."""
    for e in events:
        sink.append(from_dicts([e]))


def record_to_store(db: str, events: list[dict]) -> None:
    with AuditStore(db) as store:
        record(store, events)


def record_to_service(url: str, token: str, events: list[dict]) -> None:
    sink = HttpSink(url, token, HttpSinkConfig(timeout_s=TIMEOUT_S))
    try:
        record(sink, events)
    except ValidationError as exc:
        raise KvtrailError(f"{url}: recording refused: {exc}") from None
    except StoreError as exc:
        raise KvtrailError(f"{url}: cannot record: {exc}") from None
    finally:
        sink.close()
