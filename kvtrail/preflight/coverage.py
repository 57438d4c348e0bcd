"""Which paths of a node's page traffic kvtrail's SGLang plugin does not audit, read from SGLang's server
arguments (``/server_info``), before the node runs: the names the plugin itself declares in the node's
``node_config`` (``not audited: ...``), which ``kvtrail_node_unaudited_paths`` and ``KvtrailNodeUnaudited``
report once it runs. ``tests/preflight/test_coverage.py`` checks the names against the plugin's.
"""

from __future__ import annotations

from collections.abc import Mapping

HICACHE = "HiCache load-back and write-back allocations"  # --enable-hierarchical-cache
DECODE_OFFLOAD = "decode KV offload"  # --disaggregation-decode-enable-offload-kvcache
FAKE_BACKEND = "transfer backend fake (FakeKVSender moves no KV: no transfer_sent)"
# The backends whose senders the plugin hooks (CommonKVSender.send); the fake one moves no KV.
HOOKED_BACKENDS = ("mooncake", "nixl", "mori", "ascend")
KEYS = (
    "enable_hierarchical_cache",
    "disaggregation_decode_enable_offload_kvcache",
    "speculative_algorithm",
    "disaggregation_transfer_backend",
)


def _on(value: object) -> bool:
    return value is True or (isinstance(value, str) and value.strip().lower() in ("1", "true", "on", "yes"))


def unaudited_by_args(doc: Mapping, role: str | None) -> tuple[str, ...] | None:
    """The paths the plugin would declare not audited on a node with these server arguments; None when the
    document carries none of the arguments that decide it (the check is then left out)."""
    if not any(k in doc for k in KEYS):
        return None
    out = []
    if _on(doc.get("enable_hierarchical_cache")):
        out.append(HICACHE)
    if role == "decode" and _on(doc.get("disaggregation_decode_enable_offload_kvcache")):
        out.append(DECODE_OFFLOAD)
    spec = doc.get("speculative_algorithm")
    if isinstance(spec, str) and spec.strip() and spec.strip().upper() != "NONE":
        out.append(f"speculative decoding {spec.strip().upper()}")
    backend = doc.get("disaggregation_transfer_backend")
    if role == "prefill" and backend == "fake":
        out.append(FAKE_BACKEND)
    elif role == "prefill" and isinstance(backend, str) and backend not in HOOKED_BACKENDS:
        out.append(f"transfer backend {backend} (a sender kvtrail's plugin does not hook: no transfer_sent)")
    return tuple(out)
