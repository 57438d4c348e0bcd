"""Shared helpers: wire-format events and small stores."""

from __future__ import annotations

import fcntl
import os
import time

import pytest

T0 = 1_788_960_120_000_000_000  # 2026-09-09T13:22:00Z


@pytest.fixture(autouse=True)
def _alone_when_marked(request, tmp_path_factory):
    """Under pytest-xdist, a test marked ``alone`` runs while no other worker runs a test, and no worker
    starts one while it runs: an exclusive lock on a file the workers share, every other test holding it
    shared. Its scenario depends on the relative timing of live processes (two requests through a stack),
    which a busy neighbour on the same cores stretches. The lock covers a test's body and its function-scoped
    fixtures; a module- or session-scoped fixture another worker sets up meanwhile is outside it. In one
    process the lock is not taken."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    alone = request.node.get_closest_marker("alone") is not None
    with open(tmp_path_factory.getbasetemp().parent / "kvtrail-alone.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def producer(node="prefill-0", role="prefill", instance="i1", cluster="c1"):
    return {
        "cluster": cluster,
        "node": node,
        "role": role,
        "engine": "kvtrail-reference",
        "engine_version": "0.1",
        "instance": instance,
    }


def event(seq, kind, prod=None, wall_ns=None, request=None, **payload):
    e = {
        "schema_version": 1,
        "producer": prod or producer(),
        "seq": seq,
        "wall_ns": T0 + seq * 1000 if wall_ns is None else wall_ns,
        "mono_ns": 1000 + seq,
        "kind": kind,
    }
    if request is not None:
        e["request"] = request
    e.update(payload)
    return e


def config(seq=0, prod=None, pool_pages=64, page_size=16, **kw):
    return event(
        seq,
        "node_config",
        prod,
        pool_tokens=pool_pages * page_size,
        pool_pages=pool_pages,
        page_size=page_size,
        context_tokens=4096,
        **kw,
    )


def alloc(seq, pages, rid="r1", tenant="t1", prod=None, **kw):
    return event(
        seq,
        "pages_allocated",
        prod,
        request={"request_id": rid, "tenant_id": tenant},
        pages=pages,
        purpose=kw.pop("purpose", "prefill_extend"),
        **kw,
    )


@pytest.fixture
def store(tmp_path):
    from kvtrail.audit.store import AuditStore

    s = AuditStore(tmp_path / "audit.duckdb")
    yield s
    s.close()


def stored_events(path):
    """Every event of the store at ``path``, as dicts (read through a read-only connection)."""
    from kvtrail.audit.batch import to_dicts
    from kvtrail.audit.store import connect_readonly, read_events

    con = connect_readonly(path)
    try:
        return to_dicts(read_events(con))
    finally:
        con.close()


def run_cli(capsys, *argv: str) -> tuple[int, list[str], list[str]]:
    """Run the kvtrail command in-process: (exit code, stdout lines, stderr lines)."""
    from kvtrail.cli import main

    capsys.readouterr()
    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out.splitlines(), cap.err.splitlines()


def event_table(con, producer_id: int, seq: int) -> str:
    """The table that holds one stored event (the store keeps each kind in a table of its own)."""
    from kvtrail.audit.layout import table_name

    (kind,) = con.execute("SELECT kind FROM events WHERE producer_id = ? AND seq = ?", [producer_id, seq]).fetchone()
    return table_name(kind)


def delete_stored(con, where: str, params: list | None = None, *, tables: tuple[str, ...] = ("page_runs", "batches")):
    """DELETE the rows matching ``where`` from every kind's event table and ``tables`` (tampering in tests)."""
    from kvtrail.audit.layout import KIND_TABLES

    for table in (*KIND_TABLES, *tables):
        con.execute(f"DELETE FROM {table} WHERE {where}", params)


def wait_for(what: str, check, deadline_s: float, every_s: float = 0.05):
    """``check()``'s first truthy value, polled every ``every_s``; AssertionError naming ``what`` once
    ``deadline_s`` passes without one."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        got = check()
        if got:
            return got
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}")
