"""Preflight's audit-coverage check: what kvtrail's SGLang plugin does not audit, from SGLang's server arguments,
named as the plugin itself names it in its node_config (so preflight, the metric and the alert say the same)."""

from __future__ import annotations

import json
import types

from kvtrail.audit.configs import unaudited_paths
from kvtrail.preflight import check_node, parse_server_info
from kvtrail.preflight.coverage import DECODE_OFFLOAD, FAKE_BACKEND, HICACHE
from tests.preflight.test_preflight import DATA


def _info(**args) -> dict:
    doc = json.loads((DATA / "decode_server_info.json").read_text())
    doc.pop("internal_states", None)
    doc.update(args)
    return doc


def _coverage(doc: dict):
    [node] = parse_server_info(doc, "info.json")
    return [c for c in check_node(node, [node]) if c.check == "audit_coverage"]


def test_hicache_and_the_fake_backend_are_named_and_refused_unless_allowed():
    [c] = _coverage(_info(enable_hierarchical_cache=True, disaggregation_mode="decode"))
    assert c.status == "unknown" and HICACHE in c.detail and "--allow-unknown" in c.detail
    [c] = _coverage(_info(disaggregation_mode="prefill", disaggregation_transfer_backend="fake"))
    assert c.status == "unknown" and FAKE_BACKEND in c.detail
    [c] = _coverage(_info(disaggregation_mode="decode", speculative_algorithm="EAGLE"))
    assert c.status == "unknown" and "speculative decoding EAGLE" in c.detail


def test_a_node_with_none_of_them_passes_and_a_source_without_the_arguments_leaves_the_check_out():
    [c] = _coverage(
        _info(
            enable_hierarchical_cache=False,
            disaggregation_mode="prefill",
            disaggregation_transfer_backend="mooncake",
            speculative_algorithm=None,
        )
    )
    assert c.status == "pass"
    doc = {k: v for k, v in _info().items() if k not in ("enable_hierarchical_cache", "speculative_algorithm")}
    doc = {
        k: v for k, v in doc.items() if not k.startswith(("disaggregation_transfer", "disaggregation_decode_enable"))
    }
    assert _coverage(doc) == []


def test_the_names_are_the_plugins_own():
    """The plugin's modes.unaudited and its sender check (on a scheduler running them) name what preflight names,
    and the config_source it writes reads back as those paths (the metric's labels)."""
    from kvtrail.audit.configs import NOT_AUDITED
    from kvtrail.serving.sglang import modes, senders

    spec = types.SimpleNamespace(is_none=lambda: False, name="EAGLE")
    scheduler = types.SimpleNamespace(
        enable_hierarchical_cache=True, decode_offload_manager=object(), spec_algorithm=spec
    )
    named = modes.unaudited(scheduler)
    assert named == [HICACHE, DECODE_OFFLOAD, "speculative decoding EAGLE"]
    fake = senders.backend_gap("fake", [], cls=type("FakeKVSender", (), {"send": lambda self: None}))
    assert fake == FAKE_BACKEND
    assert unaudited_paths(f"sglang-plugin; hooks all patched; {NOT_AUDITED}{','.join([*named, fake])}") == [
        *named,
        fake,
    ]
