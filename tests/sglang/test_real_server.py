"""Real ``sglang.launch_server`` processes on CPU with kvtrail's plugin recording (slow: ~2-3 min on 2 cores).

Two unified servers are started in parallel on the tiny model made once for the module: one is stopped with
SIGTERM (SGLang's clean shutdown: the record must end clean, the plugin closes its recorder at SGLang's
ShutdownReq), the other with SIGKILL (still an unclean end; it runs two data-parallel pools, each recording
into its own file). Traffic from three tenants; a prompt over the context is refused 400 by the HTTP process,
which records the refusal (into its own file beside the node's).
"""

from __future__ import annotations

import os
import signal
import time
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.conftest import stored_events
from tests.sglang.realserver import Server, check_shims

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        tuple(int(x) for x in version("sglang").split(".")[:3]) < (0, 5, 23), reason="the unified server on 0.5.23"
    ),
]
CONTEXT = 256
TENANTS = ("tenant-a", "tenant-b", "tenant-c")
TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.sglang.tinymodel import make

    check_shims()
    t0 = time.monotonic()
    folder = make(tmp_path_factory.mktemp("tiny") / "model")
    TIMINGS["model_s"] = time.monotonic() - t0
    return folder


def pools() -> int:
    """Data-parallel pools of the SIGKILL server: two where the process may run on two cores (SGLang on CPU
    binds each pool's scheduler to cores of its own), else one."""
    return 2 if len(os.sched_getaffinity(0)) >= 2 else 1


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory):
    base = tmp_path_factory.mktemp("servers")
    flags = ["--context-length", str(CONTEXT), "--max-total-tokens", "1024"]
    term = Server(model, base / "term.duckdb", "unified-term", base / "term.log", *flags)
    if pools() == 2:
        cores = sorted(os.sched_getaffinity(0))
        flags += ["--dp-size", "2", "--load-balance-method", "round_robin"]
        kill = Server(
            model,
            base / "kill.duckdb",
            "unified-kill",
            base / "kill.log",
            *flags,
            env={"SGLANG_CPU_OMP_THREADS_BIND": f"{cores[0]}|{cores[1]}"},
        )
    else:
        kill = Server(model, base / "kill.duckdb", "unified-kill", base / "kill.log", *flags)
    started = {"term": term, "kill": kill}
    try:
        for s in started.values():
            s.wait_ready()
            TIMINGS[f"{s.node}_ready_s"] = s.ready_s or 0.0
        yield started
    finally:
        for s in started.values():
            if s.proc.poll() is None:
                s.stop(signal.SIGKILL)
        print(f"real-server timings: {TIMINGS}")


def traffic(server):
    """Two requests per tenant, and one over the context (refused by the HTTP process)."""
    answers = []
    for i, tenant in enumerate(TENANTS * 2):
        status, body = server.generate(f"the tenant asked for pages {i} " * (i + 1), tenant)
        answers.append((tenant, status, body))
    status, body = server.generate("kv cache pages " * CONTEXT, "tenant-c", rid="over-context")
    return answers, (status, body)


def test_a_sigterm_shutdown_is_a_clean_end_with_every_tenants_pages_and_statuses(servers):
    from kvtrail.audit.store import connect_readonly
    from kvtrail.audit.verify import unclean_ends
    from kvtrail.serving.sglang.plugin import refusal_store

    server = servers["term"]
    answers, (over_status, over_body) = traffic(server)
    assert all(status == 200 for _, status, _ in answers), answers
    assert over_status == 400, over_body  # the HTTP process refused it: over the context
    TIMINGS["sigterm_stop_s"] = server.stop(signal.SIGTERM)
    assert server.proc.returncode is not None

    events = stored_events(server.db)
    by_rid: dict[str, list[dict]] = {}
    for e in events:
        rid = (e.get("request") or {}).get("request_id")
        if rid:
            by_rid.setdefault(rid, []).append(e)
    for tenant, _, body in answers:
        rid = body["meta_info"]["id"]
        mine = by_rid.get(rid, [])
        kinds = {e["kind"] for e in mine}
        # (its pages stay in the radix cache after it finished: no pages_freed until an eviction)
        assert {"request_received", "pages_allocated", "kv_written", "kv_read", "response_sent"} <= kinds, (rid, kinds)
        [resp] = [e for e in mine if e["kind"] == "response_sent"]
        assert resp["http_status"] == 200 and resp["completion_tokens"] == body["meta_info"]["completion_tokens"]
        [recv] = [e for e in mine if e["kind"] == "request_received"]
        assert recv["request"]["tenant_id"] == tenant
        assert recv["prompt_tokens"] == body["meta_info"]["prompt_tokens"]
        allocated = {p for e in mine if e["kind"] == "pages_allocated" for p in e["pages"]}
        assert len(allocated) >= body["meta_info"]["prompt_tokens"]  # page size 1: a page per token
    configs = [e for e in events if e["kind"] == "node_config"]
    assert configs and all("hooks all patched" in e["config_source"] for e in configs), configs
    con = connect_readonly(server.db)
    try:
        assert unclean_ends(con, resting=True) == []  # SGLang's clean shutdown: the recorder closed first
    finally:
        con.close()
    assert any(e["kind"] == "recorder_closed" for e in events)
    # the request the HTTP process refused never reached the scheduler: its own file beside the node's
    refused = [e for e in stored_events(refusal_store(server.db)) if "request" in e]
    assert {e["request"]["request_id"] for e in refused} == {"over-context"}, refused
    assert not [e for e in events if (e.get("request") or {}).get("request_id") == "over-context"]
    by_kind = {e["kind"]: e for e in refused}
    assert set(by_kind) == {"request_received", "request_aborted", "response_sent"}
    assert {e["request"]["tenant_id"] for e in refused} == {"tenant-c"}
    assert by_kind["response_sent"]["http_status"] == 400 and by_kind["response_sent"]["completion_tokens"] == 0
    assert by_kind["request_aborted"]["stage"] == "http" and by_kind["request_aborted"]["http_status"] == 400
    assert f"context length ({CONTEXT} tokens)" in by_kind["request_aborted"]["abort_reason"]
    assert by_kind["request_received"]["prompt_tokens"] >= CONTEXT


def test_a_sigkill_is_still_an_unclean_end_of_each_data_parallel_pool(servers, tmp_path):
    """Two data-parallel pools (``--dp-size 2``), a scheduler process each: with a store file each pool records
    into its own (``kill.dp0.duckdb``, ``kill.dp1.duckdb``), where one file could have one writer only and the
    second pool would go unrecorded. After a SIGKILL each pool's record keeps what it committed and ends
    unclean; merged, the two are one record of the node's pools."""
    from kvtrail.audit.export import export_parquet, import_parquet
    from kvtrail.audit.store import connect_readonly
    from kvtrail.audit.verify import unclean_ends
    from kvtrail.serving.sglang.plugin import pool_store

    server = servers["kill"]
    n = pools()
    files = [Path(pool_store(server.db, p)) for p in range(n)] if n > 1 else [server.db]
    nodes = [f"unified-kill-dp{p}" for p in range(n)] if n > 1 else ["unified-kill"]
    sent, rids = time.time(), []
    for i in range(2 * n):  # round robin: two requests a pool
        status, body = server.generate(f"the tenant asked for pages {i} " * 2, TENANTS[i % 2])
        assert status == 200, body
        rids.append(body["meta_info"]["id"])
    for f in files:  # the requests' events are stored
        TIMINGS[f"sigkill_commit_wait_{f.stem}_s"] = server.wait_committed(sent, db=f)
    TIMINGS["sigkill_stop_s"] = server.stop(signal.SIGKILL)
    if n > 1:
        assert not server.db.exists()
    for f, node in zip(files, nodes):
        events = stored_events(f)
        assert {e["producer"]["node"] for e in events} == {node}
        assert len([e for e in events if e["kind"] == "response_sent"]) == 2, (node, events[-3:])
        assert not any(e["kind"] == "recorder_closed" for e in events)
        con = connect_readonly(f)
        try:
            ends = unclean_ends(con, resting=True)
        finally:
            con.close()
        assert [e.node for e in ends] == [node], ends
    for k, f in enumerate(files[1:]):
        export_parquet(f, tmp_path / f"pool{k}")
        import_parquet(tmp_path / f"pool{k}", files[0])
    merged = stored_events(files[0])
    assert sorted(e["request"]["request_id"] for e in merged if e["kind"] == "response_sent") == sorted(rids)
