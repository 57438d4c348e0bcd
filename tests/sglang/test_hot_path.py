"""Hot-path discipline against the real classes: prefix hits and radix evictions, failures counted as gaps,
recording on attention-TP rank 0 only, configuration from the environment."""

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
    d_new = [e for e in events if e["kind"] == "pages_allocated" and e["purpose"] == "prefill_extend"
             and e["request"]["request_id"] == "D"]
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


def test_only_attention_tp_rank_0_records(plugin):
    node = Node("decode")
    node.scheduler.attn_tp_rank = 1
    assert plugin.start(node.scheduler, sink="unused") is None and plugin.session is None


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
