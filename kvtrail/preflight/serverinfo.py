"""SGLang's ``/server_info`` JSON (also ``/get_server_info``, ``/v1/models``) and ``/metrics`` text to node
configurations.

``/server_info`` is a flat dict of the resolved server arguments plus the scheduler's ``max_total_num_tokens``,
``version`` and ``internal_states`` (one entry per DP rank, each with its own ``max_total_num_tokens`` or
``memory_usage.token_capacity``). It does not carry the effective context length: ``context_length`` is
the CLI value (``null`` unless set), read only when set; ``/v1/models``' ``max_model_len`` and the metric
``sglang:context_len`` carry the effective one. Not read, though alike: ``max_total_tokens`` (a CLI cap),
``max_req_input_len``, ``max_prefill_tokens``, ``max_context_length``, ``*_swa`` sub-pool sizes.

Keys SGLang 0.5.23 does not have but a patched build or a deployment's own wrapper may add, read when
present: ``disaggregation_deferred_kv_release`` (bool), ``disaggregation_release_timeout_s`` and
``disaggregation_transfer_batch_max_pages``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from prometheus_client.parser import text_string_to_metric_families

from kvtrail.preflight.coverage import unaudited_by_args
from kvtrail.preflight.node import ROLES, NodeConfig


def _int(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        return None
    return int(value)


def _flag(value: object) -> bool | None:
    if isinstance(value, bool):
        return value
    if value is None:
        return None
    if isinstance(value, str):
        return value.strip().lower() not in ("", "none", "null", "false", "off", "0")
    return None


def _role(value: object) -> str | None:
    return value if isinstance(value, str) and value in ROLES else None


def is_server_info(doc: Mapping) -> bool:
    """Whether a JSON object looks like a server-info body or a ``/v1/models`` answer."""
    keys = ("max_total_num_tokens", "internal_states", "page_size", "disaggregation_mode", "model_path", "version")
    return any(k in doc for k in keys) or _models_context(doc) is not None


def _models_context(doc: Mapping) -> int | None:
    data = doc.get("data")
    if isinstance(data, list) and data and isinstance(data[0], Mapping):
        return _int(data[0].get("max_model_len"))
    return None


def _common(doc: Mapping, source: str) -> NodeConfig:
    timeout_s = doc.get("disaggregation_release_timeout_s")
    timeout_ns = None if _int(timeout_s) is None else int(float(timeout_s) * 1e9)  # type: ignore[arg-type]
    version = doc.get("version")
    role = _role(doc.get("disaggregation_mode"))
    return NodeConfig(
        source=source,
        role=role,
        unaudited=unaudited_by_args(doc, role),
        pool_tokens=_int(doc.get("max_total_num_tokens")),
        context_tokens=_int(doc.get("context_length")) or _models_context(doc),
        page_size=_int(doc.get("page_size")),
        version=version if isinstance(version, str) and version else None,
        max_running_requests=_int(doc.get("max_running_requests")),
        checksum_enabled=_flag(doc.get("disaggregation_enable_kv_checksum")),
        canary_enabled=bool(_flag(doc["kv_canary"])) if "kv_canary" in doc else None,  # a resolved null: off
        deferred_release=_flag(doc.get("disaggregation_deferred_kv_release")),
        release_timeout_ns=timeout_ns or None,
        transfer_batch_max_pages=_int(doc.get("disaggregation_transfer_batch_max_pages")) or None,
        config_source="server_info",
    )


def parse_server_info(doc: Mapping, source: str) -> list[NodeConfig]:
    """One node per DP rank (``internal_states``), else one; values a rank lacks come from the top level."""
    top = _common(doc, source)
    states = doc.get("internal_states")
    if not isinstance(states, list) or not states or not all(isinstance(s, Mapping) for s in states):
        return [top]
    nodes = []
    for i, state in enumerate(states):
        mine = _common(state, source)
        usage = state.get("memory_usage")
        if mine.pool_tokens is None and isinstance(usage, Mapping):
            mine = mine.merged(NodeConfig(source, pool_tokens=_int(usage.get("token_capacity"))))
        rank = f"DP{i}" if len(states) > 1 else None
        merged = NodeConfig(source, rank=rank, role=mine.role or top.role, config_source="server_info")
        merged = merged.merged(mine)
        # the top level's pool is the scheduler handshake of DP rank 0: not every rank's
        nodes.append(merged.merged(top if len(states) == 1 else _without_pool(top)))
    return nodes


def _without_pool(node: NodeConfig) -> NodeConfig:
    return replace(node, pool_tokens=None)


_GAUGES = {
    "sglang:max_total_num_tokens": "pool_tokens",
    "sglang:context_len": "context_tokens",
    "sglang:page_size": "page_size",
}


def parse_metrics(text: str, source: str) -> list[NodeConfig]:
    """One node per DP rank (``dp_rank`` label; TP ranks share the pool) from SGLang's Prometheus text."""
    values: dict[str | None, dict[str, object]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field = _GAUGES.get(sample.name)
            if field is None or sample.value != sample.value:  # NaN: not a value
                continue
            dp = sample.labels.get("dp_rank")
            node = values.setdefault(dp, {})
            v = int(sample.value)
            old = node.get(field)
            node[field] = v if not isinstance(old, int) else min(old, v)
            role = _role(sample.labels.get("engine_type"))
            if role:
                node["role"] = role
    out = []
    for dp, found in sorted(values.items(), key=lambda kv: -1 if kv[0] is None else int(kv[0])):
        rank = f"DP{dp}" if dp is not None and len(values) > 1 else None
        out.append(NodeConfig(source, rank=rank, config_source="metrics", **found))  # type: ignore[arg-type]
    return out
