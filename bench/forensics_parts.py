"""The measured parts of bench_forensics.py, each run in a process of its own (see that script's doc).

``run_part(name, db, meta, args)`` returns the part's figures: ``wall_s`` and what it found (F1 pages,
affected responses, and how many of those the history's ground truth holds), plus the part's own
page-event count where it replays only part of the history.
"""

from __future__ import annotations

import os
import resource
import tempfile
import time

from forensics_baselines import BASELINES, baseline, compiled_expand, floor


def _summary(found) -> dict:
    """F1 pages (summed over F1 findings) and affected responses (requests with F1 or F5; an F7 request
    is the late writer, a source, as in the question)."""
    from kvtrail.forensics.findings import AFFECTED_CODES

    return {
        "f1_pages": sum(len(f.pages) for f in found if f.code == "F1"),
        "affected_ids": sorted({f.request_id for f in found if f.code in AFFECTED_CODES}),
    }


def against_truth(out: dict, meta: dict, whole: bool = True) -> dict:
    """``out`` with its affected ids replaced by counts: found, of those in the ground truth, truth size.

    ``same_question`` is whether the part's answer is the truth's; a part over a prefix of the history
    (``whole`` false) finds only part of the truth, so it is not judged.
    """
    ids = set(out.pop("affected_ids"))
    truth = set(meta["truth_affected_request_ids"])
    out.update(affected=len(ids), affected_in_truth=len(ids & truth), truth_affected=len(truth))
    if whole:
        out["same_question"] = ids == truth
    return out


def run_part(part: str, db: str, meta: dict, args) -> dict:
    """One measured part, in this process. Returns its figures (wall_s and what it found).

    Modules are imported before the clock starts (a process's start-up, not the question's cost), and
    compiled code is made ready before it too: the floor compiles its loop, and the engine's parts load
    kvtrail's kernels from numba's cache (``warm_up``; ``kernels_s`` reports the time, printed beside
    the part's). Before 2026-12-02 the engine paid that load inside its clock and the floor did not.
    """
    import duckdb

    from kvtrail.audit.store import connect_readonly
    from kvtrail.forensics.findings import AFFECTED_CODES
    from kvtrail.forensics.questions import Window, affected_responses
    from kvtrail.forensics.replay.engine import replay_store
    from kvtrail.forensics.sql.engine import sql_findings

    if part == "online":
        return against_truth(_online(db), meta)
    if part == "split":
        return against_truth(_split(db), meta)
    out: dict = {}
    t_load = time.perf_counter()
    expand = compiled_expand() if part == "floor" else None
    if part in ("question", "engine", "engine-seq"):
        import kvtrail.forensics.replay.fast  # noqa: F401  (the engine imports it on first use)
        from kvtrail.forensics.replay.kernels import warm_up

        warm_up()
    out["kernels_s"] = time.perf_counter() - t_load
    to_ns = None
    prefix = {"pure": args.pure_page_events, "sql": args.sql_page_events}.get(part, 0)
    if prefix and prefix < meta["page_events"]:  # the history up to where it holds that many page-events
        with connect_readonly(db) as con:
            row = con.execute(
                "SELECT min(wall_ns) FROM (SELECT wall_ns, sum(num_pages) OVER (ORDER BY wall_ns "
                "ROWS UNBOUNDED PRECEDING) AS cum FROM events) WHERE cum >= ?",
                [int(prefix)],
            ).fetchone()
            assert row is not None, "an aggregate query returns one row"
            to_ns = row[0]
            row = con.execute("SELECT sum(num_pages) FROM events WHERE wall_ns <= ?", [to_ns]).fetchone()
            assert row is not None, "an aggregate query returns one row"
            out["page_events"] = int(row[0])
    t0 = time.perf_counter()
    if part == "question":
        with connect_readonly(db) as con:
            df = affected_responses(con, Window())
        out.update(affected_ids=df.get_column("request_id").to_list())
    elif part in ("engine", "engine-seq", "pure"):
        with connect_readonly(db) as con:
            found = replay_store(
                con, to_ns=to_ns, codes=AFFECTED_CODES, fast=part != "pure", read_ahead=part != "engine-seq"
            )
        out.update(_summary(found))
    elif part == "sql":
        with connect_readonly(db) as con:
            found = sql_findings(con, to_ns=to_ns, codes=("F1",))
        out.update(_summary(found))
    elif part in BASELINES:
        with duckdb.connect(db, read_only=True) as con:
            out.update(baseline(con, part))
    elif part == "floor":
        with duckdb.connect(db, read_only=True) as con:
            out.update(floor(con, expand))
    else:
        raise ValueError(f"part: unknown part {part!r}")
    out["wall_s"] = time.perf_counter() - t0
    return against_truth(out, meta, whole="page_events" not in out) if "affected_ids" in out else out


def _split(db: str) -> dict:
    """The engine part in two halves: reading the store into batches, then replaying them from memory."""
    import dataclasses

    from kvtrail.audit.store import connect_readonly
    from kvtrail.forensics.findings import AFFECTED_CODES
    from kvtrail.forensics.replay.engine import ReplayEngine
    from kvtrail.forensics.replay.kernels import warm_up
    from kvtrail.forensics.replay.source import store_batches
    from kvtrail.forensics.window import window_filter

    warm_up()
    with connect_readonly(db) as con:
        ids = {
            tuple(r[1:]): r[0]
            for r in con.execute(
                "SELECT producer_id, cluster, node, role, engine, engine_version, instance FROM producers"
            ).fetchall()
        }
        t0 = time.perf_counter()
        for _ in store_batches(con, *window_filter(None, None)):
            pass
        read_s = time.perf_counter() - t0
        # again, untimed, keeping every batch (the reader reuses a batch's page buffer for a later one)
        batches = [dataclasses.replace(b, pages=b.pages.copy()) for b in store_batches(con, *window_filter(None, None))]
    engine = ReplayEngine(ids, codes=AFFECTED_CODES)
    t0 = time.perf_counter()
    for b in batches:
        engine.feed_batch(b)
    found = engine.findings()
    return {"read_s": read_s, "wall_s": time.perf_counter() - t0, **_summary(found)}


def _online(db: str) -> dict:
    """Ingest vs online replay of the same wire batches, alternating who goes first, batch by batch."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from kvtrail.audit.store import AuditStore
    from kvtrail.forensics.replay.engine import ReplayEngine

    clock = time.perf_counter
    spent = {"ingest": 0.0, "replay": 0.0}
    page_events = 0
    with (
        tempfile.TemporaryDirectory(prefix="kvtrail-bench-") as tmp,
        AuditStore(os.path.join(tmp, "online.duckdb")) as store,
        pa.ipc.open_stream(pa.OSFile(db + ".batches.arrow", "rb")) as reader,
    ):
        engine = ReplayEngine()
        for i, batch in enumerate(reader):
            table = pa.Table.from_batches([batch])
            page_events += pc.sum(pc.list_value_length(table.column("pages"))).as_py() or 0
            steps = [("ingest", store.append), ("replay", engine.feed)]
            for name, step in steps[i % 2 :] + steps[: i % 2]:
                t = clock()
                step(table)
                spent[name] += clock() - t
        t = clock()
        found = engine.findings()
        spent["replay"] += clock() - t
    return {
        "ingest_s": spent["ingest"],
        "replay_s": spent["replay"],
        "page_events": page_events,
        "wall_s": spent["replay"],
        **_summary(found),
    }


def peak_rss_bytes() -> int:
    """This process's peak resident memory. VmHWM belongs to the process image, so unlike ru_maxrss it
    does not start at the parent's size when the parent forked this process."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
