"""Hot-path discipline against the real classes: prefix hits and radix evictions, failures counted as gaps,
configuration from the environment (ranks: test_ranks.py)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import stored_events
from tests.sglang.world import PAGE_SIZE, Node, req


def _extend(node, r):
    from sglang.srt.mem_cache import allocation

    r.init_next_round_input(node.tree)
    b = node.batch([r])
    n, p = len(r.origin_input_ids), r.prefix_len
    b.prefix_lens, b.extend_lens, b.extend_num_tokens = [p], [n - p], n - p
    b.seq_lens = b.seq_lens_cpu = torch.tensor([n])
    allocation.alloc_for_extend(b)
    return r


def test_prefix_hits_carry_the_writers_block_hashes_and_evictions_return_pages_without_a_request(plugin, tmp_path):
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.common import release_kv_cache

    db = tmp_path / "audit.duckdb"
    node = Node("null", num_pages=32, radix=True)
    s = plugin.start(node.scheduler, sink=str(db))
    try:
        shared = list(range(1, 17))  # 4 full pages
        c = _extend(node, req("C", shared + [40, 41], 1))
        c.finished_reason, c.output_ids = FINISH_LENGTH(0), c.output_ids
        c.output_ids.append(5)
        release_kv_cache(c, node.tree, checkpoint=True)  # the tree keeps C's full pages
        d = _extend(node, req("D", shared + [90], 2))
        assert d.prefix_len == 16
        release_kv_cache(d, node.tree, checkpoint=False)  # D aborted: its own pages back, the tree's unlocked
        node.tree.evict(EvictParams(num_tokens=32))
    finally:
        plugin.session = None
        s.close()
    events = stored_events(db)
    [hit] = [e for e in events if e["kind"] == "pages_allocated" and e["purpose"] == "prefix_hit"]
    c_write = [e for e in events if e["kind"] == "kv_written" and e["request"]["request_id"] == "C"][0]
    assert hit["request"]["request_id"] == "D" and len(hit["pages"]) == 4
    assert hit["pages"] == c_write["pages"][:4] and hit["block_hashes"] == c_write["block_hashes"][:4]
    d_new = [
        e
        for e in events
        if e["kind"] == "pages_allocated" and e["purpose"] == "prefill_extend" and e["request"]["request_id"] == "D"
    ]
    assert d_new and not set(d_new[0]["pages"]) & set(hit["pages"])
    freed = [e for e in events if e["kind"] == "pages_freed"]
    c_freed = [p for e in freed if (e.get("request") or {}).get("request_id") == "C" for p in e["pages"]]
    assert set(c_freed) == {c_write["pages"][-1]}  # only C's partial tail page: the tree kept the rest
    evicted = [p for e in freed if e.get("request") is None for p in e["pages"]]
    assert set(evicted) == set(hit["pages"])  # the radix eviction returns the shared pages, to no request
    assert all(e["free_reason"] == "eviction" for e in freed if e.get("request") is None)


def test_a_failing_hook_never_raises_into_sglang_and_is_recorded_as_a_gap(plugin, tmp_path):
    from sglang.srt.mem_cache import allocation

    db = tmp_path / "audit.duckdb"
    node = Node("decode")
    s = plugin.start(node.scheduler, sink=str(db))
    try:
        r = req("E", list(range(8)), 3)
        node.pool.alloc([r])
        loc = node.allocator.alloc(8)
        node.pool.write((r.kv.req_pool_idx, slice(0, 8)), loc.to(torch.int32))
        b = node.batch([r])
        b.seq_lens = b.seq_lens_cpu = torch.tensor([8])
        b.req_pool_indices = b.req_pool_indices_cpu = torch.tensor([r.kv.req_pool_idx])
        s.page_size = None  # the hook's own arithmetic fails; SGLang's must not
        out = allocation.alloc_for_decode(b, 1)
        assert out.shape == (1,) and int(out[0]) // PAGE_SIZE not in set((loc // PAGE_SIZE).tolist())
    finally:
        plugin.session = None
        s.close()
    [gap] = [e for e in stored_events(db) if e["kind"] == "recorder_gap"]
    assert gap["dropped_events"] == 1 and "alloc_for_decode" in gap["detail"] and "TypeError" in gap["detail"]
    assert gap["gap_reason"] == "hook_error"


def test_configuration_comes_from_kvtrails_environment():
    from kvtrail.serving.sglang.config import PluginConfig

    assert PluginConfig.from_env({}) is None  # installed but not configured: records nothing
    c = PluginConfig.from_env({"KVTRAIL_URL": "http://audit:8080", "KVTRAIL_NODE": "p0", "KVTRAIL_CLUSTER": "eu"})
    assert c is not None and (c.sink, c.node, c.cluster, c.enforce_length) == ("http://audit:8080", "p0", "eu", False)
    c = PluginConfig.from_env({"KVTRAIL_DB": "/x.duckdb", "KVTRAIL_SGLANG_ENFORCE_LENGTH": "1"})
    assert c is not None and c.enforce_length and c.cluster == "default"
    with pytest.raises(ValueError, match="KVTRAIL_URL"):
        PluginConfig.from_env({"KVTRAIL_URL": "audit:8080"})
    with pytest.raises(ValueError, match="only one"):
        PluginConfig.from_env({"KVTRAIL_URL": "http://a", "KVTRAIL_DB": "x"})
    with pytest.raises(ValueError, match="ENFORCE"):
        PluginConfig.from_env({"KVTRAIL_DB": "x", "KVTRAIL_SGLANG_ENFORCE_LENGTH": "yes"})


def cover(pnode, room, tokens):
    """What prefill's plugin writes into the metadata slot: the tokens this transfer covers, tagged with the room."""
    from kvtrail.serving.sglang.transfer import SLOT_TAG, SLOT_TOKENS, room_tag

    pnode.metadata.cached_tokens[0][SLOT_TOKENS] = tokens
    pnode.metadata.cached_tokens[0][SLOT_TAG] = room_tag(room)


def test_decode_radix_prefix_hits_carry_the_landed_writes_block_hashes(plugin, tmp_path):
    from sglang.srt.disaggregation import decode as dmod

    from kvtrail.forensics import ask_findings, open_store
    from tests.sglang.pd import commit, decode_step, intake

    db = tmp_path / "audit.duckdb"
    pnode, dnode = Node("prefill"), Node("decode")
    s = plugin.start(dnode.scheduler, sink=str(db))
    try:
        shared = list(range(1, 9))  # 2 full pages decode's radix cache holds from A
        a = req("A", shared + [50, 51, 52], 21)
        intake(dnode, "A", 21, a.origin_input_ids)
        dnode.pool.alloc([a])
        loc = dmod.alloc_for_decode_prealloc(
            dnode.allocator,
            req=a,
            fill_len=11,
            delta_len=11,
            prefix_len=0,
            total_prefix_len=0,
            prefix_indices=None,
            uses_swa_tail=False,
            swa_tail_len=0,
            req_to_token_pool=dnode.pool,
        )
        dnode.pool.write((a.kv.req_pool_idx, slice(0, 11)), loc.to(torch.int32))
        pnode.metadata.bootstrap_room[0, 0] = 21  # what prefill's set_buf writes (its slot reaches decode)
        cover(pnode, 21, 11)  # prefill's plugin: this transfer covers all 11 tokens
        commit(dnode, pnode, a)
        assert a.finished_reason is None  # committed, not aborted
        b = req("B", shared + [70, 71], 22)
        intake(dnode, "B", 22, b.origin_input_ids)
        dnode.pool.alloc([b])
        prefix = dnode.pool.req_to_token[a.kv.req_pool_idx, :8].to(torch.int64)  # decode's radix match for B
        new = dmod.alloc_for_decode_prealloc(
            dnode.allocator,
            req=b,
            fill_len=10,
            delta_len=2,
            prefix_len=8,
            total_prefix_len=8,
            prefix_indices=prefix,
            uses_swa_tail=False,
            swa_tail_len=0,
            req_to_token_pool=dnode.pool,
        )
        dnode.pool.write((b.kv.req_pool_idx, slice(0, 8)), prefix.to(torch.int32))
        dnode.pool.write((b.kv.req_pool_idx, slice(8, 10)), new.to(torch.int32))
        b.kv.cache_protected_len = 8
        pnode.metadata.bootstrap_room[0, 0] = 22
        cover(pnode, 22, 2)  # the 2 tokens past decode's prefix
        commit(dnode, pnode, b, slot=2)
        decode_step(dnode, b)  # attention reads B's whole table, the shared pages included
    finally:
        plugin.session = None
        s.close()
    events = stored_events(db)
    [hit] = [e for e in events if e["kind"] == "pages_allocated" and e["purpose"] == "prefix_hit"]
    [wrote_a] = [e for e in events if e["kind"] == "kv_written" and e["request"]["request_id"] == "A"]
    assert hit["request"]["request_id"] == "B" and hit["pages"] == wrote_a["pages"][:2]
    assert hit["block_hashes"] == wrote_a["block_hashes"][:2]
    assert {e["status"] for e in events if e["kind"] == "transfer_received"} == {"ok"}
    [res_b] = [e for e in events if e["kind"] == "transfer_reserved" and e["request"]["request_id"] == "B"]
    assert res_b["num_tokens"] == 2 and not set(res_b["pages"]) & set(hit["pages"])
    con = open_store(db)
    try:
        found = ask_findings(con).found
    finally:
        con.close()
    assert not [(f.code, f.request_id) for f in found if f.code in ("F1", "F5")]
