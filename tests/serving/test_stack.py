"""The reference PD stack end to end: three processes, real Mooncake transfers, the incident reproduced and audited."""

import asyncio
import re

import duckdb
import httpx
import pytest

from kvtrail.audit.recorder import RecorderConfig
from kvtrail.audit.verify import verify_store
from kvtrail.serving.config import Faults, StackConfig
from kvtrail.serving.stack import Stack

# Scenarios of two requests whose timing decides what happens in a live stack: run with no other test beside them.
pytestmark = [pytest.mark.slow, pytest.mark.alone]

KEYS = {"acme": "key-acme", "globex": "key-globex", "initech": "key-initech"}
CANARY = re.compile(r"CANARY-(acme|globex|initech)-[0-9a-f]{4}")
SMALL = dict(page_size=16, prefill_pool_tokens=2048, decode_pool_tokens=8192, context_tokens=8192, max_new_tokens=48)


def prompt(tenant: str, n: int) -> str:
    code = {"acme": "a1a1", "globex": "b2b2", "initech": "c3c3"}[tenant]
    return (f"[CANARY-{tenant}-{code}] note " * (n // 20 + 1))[:n]


def complete(url, tenant, text, max_tokens=48, headers=None):
    h = {"Authorization": f"Bearer {KEYS[tenant]}", **(headers or {})}
    r = httpx.post(f"{url}/v1/completions", json={"prompt": text, "max_tokens": max_tokens}, headers=h, timeout=60)
    return r.status_code, r.json()


def foreign(tenant, body):
    text = body.get("choices", [{}])[0].get("text", "") if "choices" in body else ""
    return sorted({m.group(1) for m in CANARY.finditer(text)} - {tenant})


def query(db, sql, params=()):
    """Read the store: a Stack (still running, reads through its own store) or a file (after stop)."""
    con = db.store.cursor() if isinstance(db, Stack) else duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(sql, list(params)).fetchall()
    finally:
        con.close()


def wait_for(st, sql, timeout_s=15.0):
    """Workers commit their audit asynchronously (once a second by default): wait until ``sql`` counts something."""
    import time

    deadline = time.monotonic() + timeout_s
    while not query(st, sql)[0][0]:
        assert time.monotonic() < deadline, f"timed out waiting for: {sql}"
        time.sleep(0.02)


def incident_traffic(url):
    """Five normal acme prompts fill the decode pool; then an over-long globex prompt reuses those pages."""
    results = [("acme", *complete(url, "acme", prompt("acme", 1500))) for _ in range(5)]
    results.append(("globex", *complete(url, "globex", prompt("globex", 4000))))
    return results


def test_vulnerable_mode_leaks_another_tenants_canary_with_http_200(tmp_path):
    db = tmp_path / "v.duckdb"
    with Stack(StackConfig.incident(**SMALL), db) as st:
        results = incident_traffic(st.url)
    for tenant, status, body in results[:5]:
        assert status == 200 and foreign(tenant, body) == []
        assert "CANARY-acme-a1a1" in body["choices"][0]["text"]  # the echo model reads back its own prompt
    tenant, status, body = results[5]
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] == 4000
    assert foreign(tenant, body) == ["acme"], body["choices"][0]["text"]
    # The audit alone shows what happened: decode reserved 250 pages for 4000 tokens, prefill sent 1.
    (reserved, sent, sent_pages) = query(
        db,
        """
        SELECT r.num_tokens, s.num_tokens, s.num_pages FROM events_v r JOIN events_v s USING (transfer_id)
        WHERE r.kind = 'transfer_reserved' AND s.kind = 'transfer_sent' AND r.tenant_id IS NOT DISTINCT FROM r.tenant_id
        ORDER BY r.seq DESC LIMIT 1""",
    )[0]
    assert (reserved, sent, sent_pages) == (4000, 1, 1)
    aborted = query(db, "SELECT node, http_status, prompt_tokens FROM events_v WHERE kind = 'request_aborted'")
    assert aborted == [("prefill-0", 400, 4000)]
    statuses = query(db, "SELECT http_status FROM events_v WHERE kind = 'response_sent' ORDER BY seq")
    assert [s for (s,) in statuses] == [200] * 6
    assert verify_store(db).ok
    # The forensics replay, from the audit alone, names globex's response as affected and acme as victim.
    from kvtrail.forensics.replay.engine import replay_store

    con = duckdb.connect(str(db), read_only=True)
    findings = replay_store(con)
    con.close()
    f1 = [f for f in findings if f.code == "F1"]
    assert f1 and {f.tenant_id for f in f1} == {"globex"}
    assert "acme" in {v for f in f1 for v in f.victim_tenant_ids}
    assert {f.code for f in findings} >= {"F1", "F2", "F4", "F8"}


def test_patched_mode_rejects_and_nothing_crosses_tenants(tmp_path):
    db = tmp_path / "p.duckdb"
    with Stack(StackConfig.incident(mode="patched", **SMALL), db) as st:
        results = incident_traffic(st.url)
    assert [s for _, s, _ in results] == [200] * 5 + [400]
    assert "exceeds the KV pool" in results[5][2]["error"]["message"]
    assert all(foreign(t, b) == [] for t, _, b in results)
    # Rejected before bootstrap, allocation or transfer: no page event at all for that request.
    rid = query(db, "SELECT request_id FROM events_v WHERE kind = 'request_aborted'")[0][0]
    kinds = {k for (k,) in query(db, "SELECT kind FROM events_v WHERE request_id = ?", [rid])}
    assert kinds == {"request_received", "request_aborted", "response_sent"}


def test_bad_requests_get_clear_errors(tmp_path):
    for mode in ("vulnerable", "patched"):
        with Stack(StackConfig.incident(mode=mode, **SMALL), tmp_path / f"{mode}.duckdb") as st:
            url = st.url
            assert complete(url, "acme", prompt("acme", 9000))[0] == 400  # over the advertised context
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer nope"})
            assert r.status_code == 401
            r = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"Authorization": "Bearer key-acme"})
            assert r.status_code == 400
            r = httpx.post(
                f"{url}/v1/completions",
                json={"prompt": "x", "max_tokens": 0},
                headers={"Authorization": "Bearer key-acme"},
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
            r = httpx.post(
                f"{url}/v1/completions", json={"max_tokens": 3}, headers={"Authorization": "Bearer key-acme"}
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_decode_pool_holds_prefills_bytes_after_a_clean_transfer(tmp_path):
    db = tmp_path / "c.duckdb"
    with Stack(StackConfig(**SMALL), db) as st:
        status, _ = complete(st.url, "initech", prompt("initech", 1600))  # 100 whole pages
        assert status == 200
        wait_for(st, "SELECT count(*) FROM events_v WHERE kind = 'transfer_sent'")
        src, dst = query(
            st,
            "SELECT list(page_start ORDER BY seq) FILTER (list = 0), "
            "list(page_start ORDER BY seq) FILTER (list = 1) FROM page_runs r JOIN events_v e "
            "USING (producer_id, seq) WHERE e.kind = 'transfer_sent'",
        )[0]
        sent = query(st, "SELECT num_pages FROM events_v WHERE kind = 'transfer_sent'")[0][0]
        assert sent == 100
        src_pages = list(range(src[0], src[0] + 100)) if len(src) == 1 else None
        dst_pages = list(range(dst[0], dst[0] + 100)) if len(dst) == 1 else None
        assert src_pages and dst_pages  # fresh pools: one contiguous run on each side
        assert st.page_digest("prefill", src_pages) == st.page_digest("decode", dst_pages)
        assert st.page_digest("prefill", src_pages) != st.page_digest("decode", [p + 100 for p in dst_pages])


def test_clean_shutdown_leaves_no_process_and_flushes_every_producer(tmp_path):
    db = tmp_path / "s.duckdb"
    st = Stack(StackConfig(**SMALL), db).start()
    procs = list(st.procs.values())
    assert complete(st.url, "acme", prompt("acme", 300))[0] == 200
    st.stop()
    assert all(not p.is_alive() and p.exitcode == 0 for p in procs)
    nodes = {n for (n,) in query(db, "SELECT DISTINCT node FROM events_v")}
    assert nodes == {"router-0", "prefill-0", "decode-0"}
    assert verify_store(db).ok


# ---- fault injections: each leaves the events that evidence it ---------------------------------------

FAULT_CFG = dict(
    SMALL,
    decode_pool_tokens=512 * 16,
    prefill_pool_tokens=512 * 16,
    context_tokens=8192,
    max_new_tokens=48,
    decode_step_delay_s=0.02,
)


async def _two_requests(url, first, second, delay_s, first_headers=None, after_first=False, ready=None):
    """Start ``first``, wait ``delay_s``, start ``second``; both run concurrently. With ``after_first`` the second
    starts no sooner than the first's answer (an aborted first: its pages were freed before the answer; on a loaded
    machine the abort can take longer than ``delay_s``, and the second would find the pool still held). With
    ``ready`` (a blocking function of no arguments) the second starts no sooner than ``ready()`` returns."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:

        async def go(tenant, text, headers=None):
            h = {"Authorization": f"Bearer {KEYS[tenant]}", **(headers or {})}
            r = await c.post("/v1/completions", json={"prompt": text, "max_tokens": 48}, headers=h)
            return r.status_code, r.json()

        t1 = asyncio.create_task(go(*first, first_headers))
        await asyncio.sleep(delay_s)
        if after_first:
            await asyncio.wait([t1])
        if ready is not None:
            await asyncio.to_thread(ready)
        t2 = asyncio.create_task(go(*second))
        return await t1, await t2


# The runs that start their second request on what the store shows (_on_landing): the recorders drain every 20 ms (the
# stack's default is once a second, which would leave the first request under 1 s of decode steps nearly done by
# the time the store shows it running), and decode steps of 0.05 s keep the first reading for about 2.4 s after.
LANDED_CFG = dict(FAULT_CFG, decode_step_delay_s=0.05, recorder=RecorderConfig(flush_interval_s=0.02))


def _on_landing(st, first, second):
    """:func:`_two_requests` on a stack of ``LANDED_CFG``, the second started once the store shows the first's KV
    landed on decode. Decode's handler ran whole by then (a premature free done, the request running: what the
    faults act on), however long the first's prefill took on a loaded machine."""
    landed = "SELECT count(*) FROM events_v WHERE node = 'decode-0' AND kind = 'transfer_received'"
    return asyncio.run(_two_requests(st.url, first, second, 0.0, ready=lambda: wait_for(st, landed, 30.0)))


def test_premature_free_lets_a_running_request_read_anothers_pages(tmp_path):
    db = tmp_path / "uaf.duckdb"
    # Both requests fit only once decode freed acme's pages early (the fault, when acme's KV landed): globex starts
    # once that landing is stored, and acme is still reading when globex lands.
    cfg = StackConfig(mode="vulnerable", faults=Faults(premature_free=True), **LANDED_CFG)
    with Stack(cfg, db) as st:
        (s1, b1), (s2, b2) = _on_landing(st, ("acme", prompt("acme", 300 * 16)), ("globex", prompt("globex", 300 * 16)))
    assert (s1, s2) == (200, 200)
    assert foreign("acme", b1) == ["globex"], b1["choices"][0]["text"]  # it read globex's KV in its freed pages
    # Evidence: acme's reservation was freed before acme's first read of its page table.
    (freed_seq, read_seq) = query(
        db,
        """
        SELECT min(seq) FILTER (kind = 'pages_freed'), min(seq) FILTER (kind = 'kv_read') FROM events_v
        WHERE node = 'decode-0' AND request_id = (
            SELECT request_id FROM events_v WHERE kind = 'request_received' AND tenant_id = 'acme' LIMIT 1)""",
    )[0]
    assert freed_seq < read_seq


def test_late_write_after_abort_lands_in_reused_pages(tmp_path):
    db = tmp_path / "late.duckdb"
    cfg = StackConfig(mode="vulnerable", faults=Faults(late_write=True), **FAULT_CFG)
    with Stack(cfg, db) as st:
        (s1, b1), (s2, b2) = asyncio.run(
            _two_requests(
                st.url,
                ("acme", prompt("acme", 300 * 16)),
                ("globex", prompt("globex", 300 * 16)),
                0.2,
                first_headers={"x-kvtrail-abort-after-ms": "50"},
                after_first=True,
            )
        )
    assert s1 == 499 and s2 == 200
    assert foreign("globex", b2) == ["acme"], b2["choices"][0]["text"]
    rid = query(db, "SELECT request_id FROM events_v WHERE kind = 'request_received' AND tenant_id = 'acme' LIMIT 1")[
        0
    ][0]
    rows = query(
        db,
        "SELECT kind, source FROM events_v WHERE node = 'decode-0' AND request_id = ? "
        "AND kind IN ('pages_freed', 'kv_written') ORDER BY seq",
        [rid],
    )
    assert rows == [("pages_freed", None), ("kv_written", "transfer_in")]  # the write came after the free


def test_patched_deferred_release_defeats_the_late_write(tmp_path):
    db = tmp_path / "late-p.duckdb"
    cfg = StackConfig(mode="patched", faults=Faults(late_write=True), **FAULT_CFG)
    with Stack(cfg, db) as st:
        # Smaller requests: acme's pages stay held until its write is done, and both must fit.
        (s1, b1), (s2, b2) = asyncio.run(
            _two_requests(
                st.url,
                ("acme", prompt("acme", 200 * 16)),
                ("globex", prompt("globex", 200 * 16)),
                0.2,
                first_headers={"x-kvtrail-abort-after-ms": "50"},
            )
        )
    assert s1 == 499 and s2 == 200 and foreign("globex", b2) == []
    reasons = [
        r for (r,) in query(db, "SELECT free_reason FROM events_v WHERE node = 'decode-0' AND kind = 'pages_freed'")
    ]
    assert "deferred_release" in reasons


def test_double_allocation_hands_a_held_page_to_a_second_request(tmp_path):
    db = tmp_path / "dbl.duckdb"
    cfg = StackConfig(mode="vulnerable", faults=Faults(double_alloc=True), **LANDED_CFG)
    with Stack(cfg, db) as st:
        (s1, _), (s2, _) = _on_landing(st, ("acme", prompt("acme", 100 * 16)), ("globex", prompt("globex", 100 * 16)))
    assert (s1, s2) == (200, 200)
    # Evidence: a page allocated to globex while acme held it (no free of it in between).
    shared = query(
        db,
        """
        WITH alloc AS (
            SELECT e.request_id, e.seq, r.page_start + i AS page FROM events_v e
            JOIN page_runs r USING (producer_id, seq), range(r.num_pages) t(i)
            WHERE e.node = 'decode-0' AND e.kind = 'pages_allocated' AND e.purpose = 'decode_reservation')
        SELECT count(*) FROM alloc a JOIN alloc b ON a.page = b.page AND a.request_id <> b.request_id
        AND a.seq < b.seq""",
    )[0][0]
    assert shared == 1


def test_a_worker_killed_mid_transfer_fails_its_requests_and_the_other_keeps_running(tmp_path):
    db = tmp_path / "kill.duckdb"
    cfg = StackConfig(mode="patched", faults=Faults(late_write=True), **FAULT_CFG)
    with Stack(cfg, db) as st:

        async def scenario():
            async with httpx.AsyncClient(base_url=st.url, timeout=60) as c:
                h = {"Authorization": "Bearer key-acme", "x-kvtrail-abort-after-ms": "5000"}
                task = asyncio.create_task(c.post("/v1/completions", json={"prompt": prompt("acme", 1600)}, headers=h))
                await asyncio.sleep(0.25)  # prefill is holding the transfer
                st.procs["prefill"].kill()
                return await task

        r = asyncio.run(scenario())
        assert r.status_code in (502, 503)
        assert st.procs["decode"].is_alive()
        health = httpx.get(f"{st.url}/health")
        assert health.status_code == 503 and health.json() == {"prefill": False, "decode": True, "audit": "ok"}
        assert complete(st.url, "globex", prompt("globex", 300))[0] == 502  # fails fast, no hang
    # Decode released the stranded reservation, and nothing leaked.
    rows = query(db, "SELECT kind, free_reason FROM events_v WHERE node = 'decode-0' AND kind = 'pages_freed'")
    assert rows and all(reason == "abort" for _, reason in rows)


def test_patched_page_tags_stop_use_after_free_and_double_allocation(tmp_path):
    for fault in ("premature_free", "double_alloc"):
        db = tmp_path / f"tags-{fault}.duckdb"
        cfg = StackConfig(mode="patched", faults=Faults(**{fault: True}), **LANDED_CFG)
        with Stack(cfg, db) as st:
            (s1, b1), (s2, b2) = _on_landing(
                st, ("acme", prompt("acme", 300 * 16)), ("globex", prompt("globex", 200 * 16))
            )
        # acme's pages changed hands under it: it is stopped before it attends a foreign page.
        assert s1 == 500 and "page ownership tag mismatch" in b1["error"]["message"], (fault, b1)
        assert foreign("globex", b2) == [] and foreign("acme", b1) == []
        reasons = [r for (r,) in query(db, "SELECT abort_reason FROM events_v WHERE kind = 'request_aborted'")]
        assert any("page ownership tag mismatch" in r for r in reasons)


def test_corrupted_transfer_is_localised_to_its_page_by_digests(tmp_path):
    for mode, expect in (("patched", 500), ("vulnerable", 200)):
        db = tmp_path / f"corrupt-{mode}.duckdb"
        with Stack(StackConfig(mode=mode, faults=Faults(corrupt_transfer=True), **SMALL), db) as st:
            status, body = complete(st.url, "initech", prompt("initech", 800))
        assert status == expect, body
        if mode == "patched":
            assert "KV digest mismatch on pages" in body["error"]["message"]
        (status_rec,) = query(db, "SELECT status FROM events_v WHERE kind = 'transfer_received'")[0]
        assert status_rec == "mismatch"
        # Prefill's and decode's per-page digests differ on exactly the corrupted (first) page.
        sent, landed = query(
            db,
            """
            SELECT (SELECT page_digests FROM events_v WHERE node = 'prefill-0' AND kind = 'kv_written'),
                   (SELECT page_digests FROM events_v WHERE node = 'decode-0' AND kind = 'kv_written')""",
        )[0]
        assert len(sent) == len(landed) == 50
        assert [i for i, (a, b) in enumerate(zip(sent, landed)) if a != b] == [0]
