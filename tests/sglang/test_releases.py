"""Page returns SGLang makes outside a plain release: retracts (released before the request is marked), free
groups (applied at their end), and the modes the plugin does not audit (named, not silent)."""

from __future__ import annotations

from tests.conftest import stored_events
from tests.sglang.pd import extend
from tests.sglang.world import PAGE_SIZE, Node, req


def _freed(events):
    return [
        ((e.get("request") or {}).get("request_id"), e["free_reason"], sorted(e["pages"]))
        for e in events
        if e["kind"] == "pages_freed"
    ]


def _pages(node, r):
    row = node.pool.req_to_token[r.kv.req_pool_idx, : len(r.origin_input_ids)]
    return sorted(set((row // PAGE_SIZE).tolist()))


def test_a_retracted_requests_pages_are_freed_as_a_retract(plugin, tmp_path):
    from sglang.srt.managers import schedule_batch

    db = tmp_path / "audit.duckdb"
    node = Node("null")
    s = plugin.start(node.scheduler, sink=str(db))
    try:
        r = extend(node, req("R", list(range(10)), 5))
        pages = _pages(node, r)
        assert not r.is_retracted
        schedule_batch.release_req(
            req=r,
            remaing_req_count=1,
            req_to_token_pool=node.pool,
            token_to_kv_pool_allocator=node.allocator,
            tree_cache=node.tree,
            hisparse_coordinator=None,
            offload_kv=False,
        )
        assert r.is_retracted  # SGLang marks it only after the release
    finally:
        plugin.session = None
        s.close()
    assert _freed(stored_events(db)) == [("R", "retract", pages)]


def test_frees_a_free_group_postpones_keep_their_requests(plugin, tmp_path):
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.common import release_kv_cache

    db = tmp_path / "audit.duckdb"
    node = Node("null")
    s = plugin.start(node.scheduler, sink=str(db))
    try:
        a = extend(node, req("GA", list(range(10)), 6))
        b = extend(node, req("GB", list(range(100, 107)), 7))
        pa, pb = _pages(node, a), _pages(node, b)
        loose = node.allocator.alloc(PAGE_SIZE)  # pages no request holds (a cache's own)
        b.finished_reason = FINISH_LENGTH(0)
        node.allocator.free_group_begin()  # as batch result processing does around its finishes
        release_kv_cache(a, node.tree, checkpoint=False)
        release_kv_cache(b, node.tree, checkpoint=True)
        node.allocator.free(loose)
        before = node.allocator.available_size()
        node.allocator.free_group_end()
        assert node.allocator.available_size() == before + 6 * PAGE_SIZE  # returned at the group's end only
    finally:
        plugin.session = None
        s.close()
    freed = sorted(_freed(stored_events(db)), key=lambda x: str(x[0]))
    assert freed == sorted(
        [("GA", "abort", pa), ("GB", "finish", pb), (None, "eviction", sorted(set((loose // PAGE_SIZE).tolist())))],
        key=lambda x: str(x[0]),
    )


def test_modes_the_plugin_does_not_audit_are_named_in_the_node_config_and_warned(plugin, tmp_path, capsys):
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    db = tmp_path / "audit.duckdb"
    node = Node("decode")
    node.scheduler.token_to_kv_pool_allocator = object.__new__(SWATokenToKVPoolAllocator)
    node.scheduler.spec_algorithm = SpeculativeAlgorithm.EAGLE
    s = plugin.start(node.scheduler, sink=str(db))
    plugin.session = None
    s.close()
    err = capsys.readouterr().err
    assert "does not audit" in err and "SWATokenToKVPoolAllocator" in err and "EAGLE" in err
    [cfg] = [e for e in stored_events(db) if e["kind"] == "node_config"]
    assert cfg["config_source"] == (
        "sglang-plugin; hooks all patched; not audited: allocator SWATokenToKVPoolAllocator,speculative decoding EAGLE"
    )
    plain = Node("decode")
    plain.scheduler.token_to_kv_pool_allocator = plain.allocator
    plain.scheduler.spec_algorithm = SpeculativeAlgorithm.NONE
    from kvtrail.serving.sglang.modes import unaudited

    assert unaudited(plain.scheduler) == []


def test_hicache_and_context_parallelism_are_declared_not_audited(plugin, tmp_path, capsys):
    """HiCache loads pages back through PagedTokenToKVPoolAllocator.alloc, which no hook sees; attention CP
    shards each page's content across ranks: the node says so instead of recording as if it saw them."""
    from sglang.srt import runtime_context

    from tests.sglang.world import publish

    db = tmp_path / "hicache.duckdb"
    node = Node("decode")
    node.scheduler.enable_hierarchical_cache = True
    publish("decode", tp_size=2, world_rank=0)
    runtime_context.get_parallel().override_permanently(attn_cp_size=2, attn_tp_size=1)
    try:
        s = plugin.start(node.scheduler, sink=str(db))
        plugin.session = None
        s.close()
    finally:
        publish()
    assert "HiCache" in capsys.readouterr().err
    [cfg] = [e for e in stored_events(db) if e["kind"] == "node_config"]
    assert cfg["config_source"] == (
        "sglang-plugin; hooks all patched; not audited: HiCache load-back and "
        "write-back allocations,context parallelism attn_cp_size=2"
    )
