"""Who records, read from SGLang's own parallel state (its runtime context, as the launcher publishes it), and
when: a scheduler records once its pools exist, whichever way it was built.

The scheduler stand-in carries no rank attribute (SGLang 0.5.23's Scheduler has none): every placement here
is published with ``runtime_context.publish(..., ranks=SpawnRanks(...))``, SGLang's own launcher call.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from tests.conftest import stored_events
from tests.sglang.conftest import SharedStore
from tests.sglang.world import MODEL, PAGE_SIZE, Node, publish, req


@pytest.fixture
def republish(plugin):
    """Tests publish their own placement; the session's single-rank context comes back after each."""
    yield
    plugin.session = None
    publish()


def _extend(node, r):
    from sglang.srt.mem_cache import allocation

    r.init_next_round_input(node.tree)
    b = node.batch([r])
    n = len(r.origin_input_ids)
    b.prefix_lens, b.extend_lens, b.extend_num_tokens = [0], [n], n
    b.seq_lens = b.seq_lens_cpu = torch.tensor([n])
    allocation.alloc_for_extend(b)


def test_attention_tp_rank_1_records_nothing(plugin, republish, tmp_path):
    publish("decode", tp_size=2, world_rank=1)
    assert plugin.start(Node("decode").scheduler, sink=str(tmp_path / "a.duckdb")) is None
    assert plugin.session is None


def test_tp_2_records_on_rank_0_under_the_node_name(plugin, republish, tmp_path):
    db = tmp_path / "tp.duckdb"
    publish("null", tp_size=2, world_rank=0)
    node = Node("null")
    s = plugin.start(node.scheduler, sink=str(db))
    assert s is not None
    try:
        _extend(node, req("T", list(range(12)), 5))
    finally:
        plugin.session = None
        s.close()
    events = stored_events(db)
    assert {e["producer"]["node"] for e in events} == {"sg-node"}
    [cfg] = [e for e in events if e["kind"] == "node_config"]
    assert cfg["config_source"].startswith("sglang-plugin; hooks all patched")
    assert "not audited" not in cfg["config_source"]
    assert [e["request"]["request_id"] for e in events if e["kind"] == "pages_allocated"] == ["T"]


@pytest.mark.parametrize(
    "layout",
    [
        dict(tp_size=2, dp_size=2, enable_dp_attention=True),  # DP attention: one pool per attention-DP rank
        dict(dp_size=2),  # DP replicas: one pool per dp_rank
    ],
)
def test_each_dp_rank_is_its_own_producer_and_equal_page_ids_do_not_collide(plugin, republish, tmp_path, layout):
    from kvtrail.forensics import ask_findings, open_store
    from kvtrail.forensics.replay.engine import replay_store
    from kvtrail.forensics.sql.engine import sql_findings

    db = tmp_path / "dp.duckdb"
    store = SharedStore(db)
    width = layout.get("tp_size", 1) // 2  # world ranks per DP pool
    sessions, nodes = [], []
    try:
        for dp in (0, 1):
            publish("null", world_rank=dp * width, dp_rank=dp, **layout)
            nodes.append(Node("null"))
            sessions.append(plugin.start(nodes[-1].scheduler, sink=store))
            assert sessions[-1] is not None
        for dp, (node, s) in enumerate(zip(nodes, sessions)):
            plugin.session = s
            _extend(node, req(f"R{dp}", list(range(100 * dp, 100 * dp + 16)), 10 + dp))
            s.resolver.drain()
    finally:
        plugin.session = None
        for s in sessions:
            s.close()
        store.store.close()
    events = stored_events(db)
    allocs = {e["producer"]["node"]: e["pages"] for e in events if e["kind"] == "pages_allocated"}
    assert set(allocs) == {"sg-node-dp0", "sg-node-dp1"}
    assert allocs["sg-node-dp0"] == allocs["sg-node-dp1"]  # the same page ids, in two pools
    con = open_store(db)
    try:
        found = replay_store(con)
        assert sql_findings(con) == found
        # each pool is small beside the model's context (F8, per DP node); no double ownership across them
        assert sorted((f.code, f.node) for f in found) == [("F8", "sg-node-dp0"), ("F8", "sg-node-dp1")]
        assert {f.code for f in ask_findings(con).found} == {"F8"}
    finally:
        con.close()


def test_an_unknown_attention_rank_records_nothing_and_says_why(plugin, republish, capsys):
    from sglang.srt import runtime_context

    publish("null", tp_size=2, world_rank=0)
    runtime_context.get_parallel().clear_stamp()  # the widths stay published, the ranks are gone
    assert plugin.start(Node("null").scheduler, sink="unused") is None
    assert "unknown" in capsys.readouterr().err


def test_a_scheduler_built_without_init_disaggregation_records_from_its_first_request(plugin, republish, tmp_path):
    """A unified scheduler a harness built itself: its pools exist, its first request starts the recording."""
    from sglang.srt.managers.scheduler import Scheduler

    db = tmp_path / "harness.duckdb"
    node = Node("null")
    sched = object.__new__(Scheduler)
    sched.token_to_kv_pool_allocator, sched.page_size = node.allocator, PAGE_SIZE
    sched.max_total_num_tokens, sched.model_config, sched.max_running_requests = 64 * PAGE_SIZE, MODEL, 16
    sched.server_args = publish("null")
    sched._handle_generate_request = lambda *a, **k: None
    saved = plugin.config
    plugin.config = dataclasses.replace(saved, sink=str(db))
    plugin._started.discard(id(sched))
    try:
        recv = types.SimpleNamespace(
            rid="H",
            bootstrap_room=None,
            input_ids=[1, 2, 3],
            input_embeds=None,
            mm_inputs=None,
            sampling_params=types.SimpleNamespace(max_new_tokens=4),
            extra_key="tenant-h",
        )
        Scheduler.handle_generate_request(sched, recv)
        s = plugin.session
        assert s is not None and s.role == "unified"
    finally:
        plugin.config = saved
        if plugin.session is not None:
            plugin.session.close()
        plugin.session = None
    events = stored_events(db)
    kinds = [e["kind"] for e in events]
    assert "node_config" in kinds and kinds.index("node_config") < kinds.index("request_received")
    [cfg] = [e for e in events if e["kind"] == "node_config"]
    assert cfg["producer"]["role"] == "unified" and cfg["pool_tokens"] == 64 * PAGE_SIZE
    [got] = [e for e in events if e["kind"] == "request_received"]
    assert got["request"]["request_id"] == "H" and got["prompt_tokens"] == 3


def test_with_a_store_file_each_dp_pool_records_into_its_own(plugin, republish, tmp_path):
    """Each DP pool's scheduler is its own process and a DuckDB file has one writer: with ``KVTRAIL_DB`` the
    pools write ``node.dp<N>.duckdb`` beside it (one file for two processes: the second could not open it,
    and its pool would go unrecorded), merged like any two nodes' files."""
    from kvtrail.audit.export import export_parquet, import_parquet
    from kvtrail.serving.sglang.plugin import pool_store

    db = tmp_path / "node.duckdb"
    files = [tmp_path / "node.dp0.duckdb", tmp_path / "node.dp1.duckdb"]
    assert [pool_store(db, dp) for dp in (0, 1)] == [str(f) for f in files]
    for dp in (0, 1):
        publish("null", world_rank=0, dp_rank=dp, dp_size=2)  # DP replicas: each its own world of one
        node = Node("null")
        s = plugin.start(node.scheduler, sink=str(db))
        assert s is not None
        try:
            _extend(node, req(f"R{dp}", list(range(100 * dp, 100 * dp + 16)), 10 + dp))
            s.resolver.drain()
        finally:
            plugin.session = None
            s.close()
    assert not db.exists()
    for dp, f in enumerate(files):
        events = stored_events(f)
        assert {e["producer"]["node"] for e in events} == {f"sg-node-dp{dp}"}
        assert [e["request"]["request_id"] for e in events if e["kind"] == "pages_allocated"] == [f"R{dp}"]
    export_parquet(files[1], tmp_path / "dp1-export")
    import_parquet(tmp_path / "dp1-export", files[0])
    allocs = {e["producer"]["node"] for e in stored_events(files[0]) if e["kind"] == "pages_allocated"}
    assert allocs == {"sg-node-dp0", "sg-node-dp1"}
