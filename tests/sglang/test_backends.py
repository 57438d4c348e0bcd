"""Every PD transfer backend SGLang 0.5.23 ships records its sends, or the node says it does not.

Mooncake's, Mori's and Ascend's modules need their transfer engines to import, so what their senders run is
read from SGLang's own source (``ast``); NIXL's and the fake backend's import here and are resolved through
SGLang's ``get_kv_class`` like a server does. The fake backend's real ``FakeKVSender`` moves nothing and is
named in ``node_config``, as is any sender whose ``send`` no hook sees.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from tests.conftest import stored_events
from tests.sglang.world import Node


def _classes(module: str) -> dict[str, ast.ClassDef]:
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin is not None
    path = Path(spec.origin).parent / "srt" / "disaggregation" / module / "conn.py"
    return {n.name: n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)}


def _runs_super_send(cls: ast.ClassDef) -> bool:
    [send] = [f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "send"]
    return any(
        isinstance(c, ast.Call)
        and isinstance(c.func, ast.Attribute)
        and c.func.attr == "send"
        and isinstance(c.func.value, ast.Call)
        and getattr(c.func.value.func, "id", "") == "super"
        for c in ast.walk(send)
    )


def _defines_send(cls: ast.ClassDef) -> bool:
    return any(isinstance(f, ast.FunctionDef) and f.name == "send" for f in cls.body)


def test_every_shipped_backend_has_a_sender_the_plugin_knows():
    from sglang.srt.disaggregation.utils import TransferBackend

    from kvtrail.serving.sglang.senders import SENDERS

    assert {b.value for b in TransferBackend} == set(SENDERS)


@pytest.mark.parametrize("backend", ["mooncake", "mori", "ascend", "nixl"])
def test_senders_that_cannot_import_here_send_through_the_hooked_common_sender(backend):
    """In SGLang's source: the backend's sender reaches CommonKVSender.send (inherited, or its override calls
    super().send: the plugin's list of such overrides is exactly those)."""
    from kvtrail.serving.sglang.senders import DELEGATES, SENDERS

    name = SENDERS[backend]
    chain = []
    module, cls = backend, _classes(backend)[name]
    while True:
        chain.append(cls.name)
        if _defines_send(cls):
            assert cls.name in DELEGATES and _runs_super_send(cls), f"{cls.name}.send does not call super().send"
        base = cls.bases[0]
        base_name = base.id if isinstance(base, ast.Name) else base.attr
        if base_name == "CommonKVSender":
            break
        if base_name == "MooncakeKVSender":
            module = "mooncake"
        cls = _classes(module)[base_name]
    assert chain[-1] in ("MooncakeKVSender", "NixlKVSender", "MoriKVSender")


def test_nixl_resolves_to_the_patched_common_sender(plugin):
    from kvtrail.serving.sglang import targets as T
    from kvtrail.serving.sglang.senders import backend_gap, send_target, sender_class

    assert backend_gap("nixl", plugin.missing) is None
    assert send_target(sender_class("nixl")) == T.SEND
    assert T.SEND not in plugin.missing
    assert "not patched" in backend_gap("nixl", [T.SEND])


def test_a_sender_whose_send_no_hook_sees_is_named_in_node_config(plugin, tmp_path):
    from sglang.srt.disaggregation.common.conn import CommonKVSender

    from kvtrail.serving.sglang.senders import backend_gap

    class OwnSender(CommonKVSender):  # a backend whose sender moves pages its own way
        def send(self, kv_indices, state_indices=None, num_kv_tokens=None, indices_event=None):
            return None

    assert "OwnSender.send not hooked" in backend_gap("own", [], OwnSender)
    assert "sender not resolved" in backend_gap("own", [])  # no such backend in SGLang

    db = tmp_path / "own.duckdb"
    node = Node("prefill")
    node.scheduler.server_args.disaggregation_transfer_backend = "own"
    s = plugin.start(node.scheduler, sink=str(db))
    plugin.session = None
    s.close()
    [cfg] = [e for e in stored_events(db) if e["kind"] == "node_config"]
    assert "not audited: transfer backend own (sender not resolved" in cfg["config_source"]


def test_the_fake_backend_is_named_as_moving_no_kv(plugin, tmp_path):
    """The fake backend's real sender is no CommonKVSender and sends nothing: the node says so."""
    from sglang.srt.disaggregation.fake.conn import FakeKVSender

    from kvtrail.serving.sglang.senders import send_target, sender_class

    assert sender_class("fake") is FakeKVSender and send_target(FakeKVSender) is None
    db = tmp_path / "fake.duckdb"
    node = Node("prefill")
    node.scheduler.server_args.disaggregation_transfer_backend = "fake"
    s = plugin.start(node.scheduler, sink=str(db))
    plugin.session = None
    s.close()
    [cfg] = [e for e in stored_events(db) if e["kind"] == "node_config"]
    assert "hooks all patched; not audited: transfer backend fake (FakeKVSender moves no KV" in cfg["config_source"]


def test_decode_nodes_are_not_judged_on_the_sender(plugin, tmp_path):
    db = tmp_path / "decode.duckdb"
    node = Node("decode")
    node.scheduler.server_args.disaggregation_transfer_backend = "fake"
    s = plugin.start(node.scheduler, sink=str(db))
    plugin.session = None
    s.close()
    [cfg] = [e for e in stored_events(db) if e["kind"] == "node_config"]
    assert "transfer backend" not in cfg["config_source"]


def test_a_send_whose_decode_pages_prefill_does_not_know_is_a_gap(plugin, tmp_path):
    """No handshake info for the room: the send cannot be stored (decode's pages are required), so it is a
    recorder_gap naming the transfer, not an event the store rejects."""
    import numpy as np
    import torch
    from sglang.srt.mem_cache import allocation

    from tests.sglang.pd import intake
    from tests.sglang.world import PAGE_SIZE, FakeMooncake, req, sender

    db = tmp_path / "nodst.duckdb"
    node = Node("prefill")
    s = plugin.start(node.scheduler, sink=str(db))
    mgr = FakeMooncake()
    try:
        intake(node, "N", 88, list(range(8)))
        r = req("N", list(range(8)), 88)
        r.init_next_round_input(node.tree)
        b = node.batch([r])
        b.prefix_lens, b.extend_lens, b.extend_num_tokens = [0], [8], 8
        b.seq_lens = b.seq_lens_cpu = torch.tensor([8])
        allocation.alloc_for_extend(b)
        pages = (node.pool.req_to_token[r.kv.req_pool_idx, :8][::PAGE_SIZE] // PAGE_SIZE).numpy().astype(np.int32)
        snd = sender(mgr, 88, len(pages), np.array([5, 6]))
        mgr.transfer_infos.pop(88)  # the handshake's info for the room is gone
        snd.send(pages, num_kv_tokens=8)
        assert len(mgr.requests) == 1  # SGLang's send ran
    finally:
        plugin.session = None
        s.close()
    events = stored_events(db)
    assert not [e for e in events if e["kind"] == "transfer_sent"]
    [gap] = [e for e in events if e["kind"] == "recorder_gap"]
    assert gap["gap_reason"] == "invalid" and "transfer 88" in gap["detail"] and gap["dropped_events"] == 1


def test_a_hook_check_after_the_start_names_the_backend_it_leaves_unaudited(plugin, tmp_path, capsys):
    from sglang.srt.plugins.hook_registry import HookRegistry

    from kvtrail.serving.sglang import targets as T

    saved = plugin.missing
    db = tmp_path / "late-check.duckdb"
    node = Node("prefill")
    node.scheduler.server_args.disaggregation_transfer_backend = "nixl"
    s = plugin.start(node.scheduler, sink=str(db))
    try:
        assert plugin.check(set(HookRegistry._patched) - {T.SEND}) == [T.SEND]
    finally:
        plugin.session = None
        s.close()
        plugin.missing = saved
    assert T.SEND in capsys.readouterr().err
    first, second = [e["config_source"] for e in stored_events(db) if e["kind"] == "node_config"]
    assert "not audited" not in first
    assert second.startswith(f"sglang-plugin; hooks missing: {T.SEND}; not audited: transfer backend nixl")
