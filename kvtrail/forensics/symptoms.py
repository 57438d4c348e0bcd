"""What the record shows that is not a finding, but that every answer over it must mention.

* **Shared transfer ids** - a transfer id carried by events of more than one request on one side of a
  transfer in the window: two request ids for it on the prefill nodes (or on the decode nodes, or another
  role's) of one cluster, or the id in more than one cluster (a collision, a replayed id, a producer bug).
  One request on prefill and another on decode is no collision: SGLang's bootstrap room is the transfer's
  identity and each side records its own request id; the engines join that pair as one transfer
  (``docs/findings.md``, "Cross-node rules"). A collision joins nothing across requests, but the record
  itself is suspect: each answer and report carries an integrity warning naming them.
* **Empty 2xx after an abort** - a request aborted on some node whose client still got a 2xx with no
  completion tokens (SGLang's "abort returns 200 with finish_reason length"). Not F4, which needs
  output, and not exposure; shown beside the findings so that nobody mistakes it for a clean success.
* **Unclean ends** - a producer instance that stopped without ``recorder_closed``
  (:func:`kvtrail.audit.verify.unclean_ends`): its events after its last stored one, up to its flush
  bound, may be lost. Requests in flight then (events of their cluster reaching past that last event,
  starting before the gap closes) are incomplete: their transfer comparisons (F2, F3) may lack the
  other side, so those findings are withheld and the requests named as a coverage gap instead.
* **Reported losses** - events a producer's recorder numbered but could not store, and said so in a
  ``recorder_gap`` event (its buffer was full, the store refused them, the store was unreachable).
  ``kvtrail audit verify`` counts them as explained, but an answer over the window could not check what
  they recorded: it may miss findings and its counts may be low, so every answer and report says so, per
  producer instance and reason.
"""

from __future__ import annotations

import duckdb
import polars as pl

from kvtrail.audit.layout import REQUESTS_TABLE, has_kind_tables, kind_rows
from kvtrail.audit.verify import UncleanEnd, unclean_ends
from kvtrail.forensics.findings import Finding
from kvtrail.forensics.window import Window, kind_window_filter, window_filter

# Findings that compare two nodes' records of one transfer: unreliable when one side's tail is lost.
INCOMPLETE_CODES = frozenset({"F2", "F3"})

# How many ids a warning names before it says "and N more".
SHOWN_IDS = 5


def _windowed(w: Window) -> tuple[str, list]:
    where, params = window_filter(w.from_ns, w.to_ns)
    return f"(SELECT * FROM events_v WHERE {where})", params


def shared_transfer_ids(
    con: duckdb.DuckDBPyConnection, w: Window = Window(), *, kinds: bool | None = None
) -> pl.DataFrame:
    """Transfer ids that collide in the window (more than one request id on one side of one cluster, or the
    id in more than one cluster): (transfer_id, request_ids, num_events). ``kinds``: whether the store has
    its kind tables (None: look)."""
    schema: dict[str, pl.DataType] = {
        "transfer_id": pl.UInt64(),
        "request_ids": pl.List(pl.Utf8),
        "num_events": pl.Int64(),
    }
    if has_kind_tables(con) if kinds is None else kinds:  # the dictionary: every (request, transfer) events carry
        row = con.execute(f"""SELECT count(*) FROM (SELECT transfer_id FROM {REQUESTS_TABLE}
                              WHERE transfer_id IS NOT NULL AND request_id IS NOT NULL GROUP BY transfer_id
                              HAVING count(DISTINCT request_id) > 1)""").fetchone()
        if not (row and row[0]):  # no id shared by two requests anywhere: none in the window either
            return pl.DataFrame(schema=schema)
    ev, params = _windowed(w)
    rows = con.execute(
        f"""
        WITH t AS (SELECT transfer_id, cluster, CASE WHEN role = 'unified' THEN 'prefill' ELSE role END AS side,
                          request_id FROM {ev} WHERE transfer_id IS NOT NULL AND request_id IS NOT NULL),
        sides AS (SELECT transfer_id, max(n) AS most FROM (SELECT transfer_id, cluster, side,
                  count(DISTINCT request_id) AS n FROM t GROUP BY ALL) GROUP BY transfer_id)
        SELECT transfer_id, list(DISTINCT request_id ORDER BY request_id), count(*)
        FROM t JOIN sides USING (transfer_id)
        GROUP BY transfer_id
        HAVING count(DISTINCT request_id) > 1 AND (any_value(most) > 1 OR count(DISTINCT cluster) > 1)
        ORDER BY transfer_id""",
        params,
    ).fetchall()
    return pl.DataFrame([{"transfer_id": t, "request_ids": r, "num_events": n} for t, r, n in rows], schema=schema)


def empty_after_abort(
    con: duckdb.DuckDBPyConnection, w: Window = Window(), *, kinds: bool | None = None
) -> pl.DataFrame:
    """2xx responses with no completion tokens to requests aborted on some node (same attempt: the
    transfer ids agree where both events carry one). ``kinds``: as for :func:`shared_transfer_ids`."""
    if has_kind_tables(con) if kinds is None else kinds:  # the two kinds' tables, with requests and node
        where, wp = kind_window_filter(w.from_ns, w.to_ns, "x")  # the same filter on both kinds' rows
        responses = (
            f"(SELECT x.* FROM {kind_rows('response_sent', 'x')} SEMI JOIN producers p "
            f"ON p.producer_id = x.producer_id WHERE {where})"
        )
        aborts = (
            f"(SELECT x.*, p.node FROM {kind_rows('request_aborted', 'x')} JOIN producers p "
            f"ON p.producer_id = x.producer_id WHERE {where})"
        )
        is_abort, is_response, params = "TRUE", "TRUE", wp + wp
    else:
        ev, wp = _windowed(w)
        responses, aborts, params = ev, ev, wp + wp
        is_abort, is_response = "a.kind = 'request_aborted'", "r.kind = 'response_sent'"
    rows = con.execute(
        f"""
        SELECT r.request_id, any_value(r.tenant_id), r.http_status, r.wall_ns,
               list(DISTINCT a.node || ' ' || a.stage || ': ' || a.abort_reason ORDER BY
                    a.node || ' ' || a.stage || ': ' || a.abort_reason)
        FROM {responses} r JOIN {aborts} a
          ON {is_abort} AND a.request_id = r.request_id
         AND (a.transfer_id IS NULL OR r.transfer_id IS NULL OR a.transfer_id = r.transfer_id)
        WHERE {is_response} AND r.http_status BETWEEN 200 AND 299 AND r.completion_tokens = 0
        GROUP BY r.request_id, r.http_status, r.wall_ns, r.producer_id, r.seq
        ORDER BY r.wall_ns, r.request_id""",
        params,
    ).fetchall()
    return pl.DataFrame(
        [
            {"request_id": rid, "tenant_id": t, "http_status": s, "response_ns": ns, "aborts": a}
            for rid, t, s, ns, a in rows
        ],
        schema={
            "request_id": pl.Utf8,
            "tenant_id": pl.Utf8,
            "http_status": pl.Int32,
            "response_ns": pl.Int64,
            "aborts": pl.List(pl.Utf8),
        },
    )


def gap_rows(con: duckdb.DuckDBPyConnection, w: Window, kinds: bool | None) -> tuple[str, str, list]:
    """The ``recorder_gap`` rows of the batches that overlap window ``w`` (every batch without bounds), as
    (CTE ``sel`` of those batches, a relation ``e`` of the gap rows restricted to them, parameters)."""
    bounds = [("max_wall_ns >= ?", w.from_ns), ("min_wall_ns <= ?", w.to_ns)]
    where = " AND ".join(cond for cond, v in bounds if v is not None) or "true"
    in_window = "SEMI JOIN sel USING (producer_id, batch_no)" if where != "true" else ""
    if has_kind_tables(con) if kinds is None else kinds:
        gaps = f"(SELECT e.* FROM {kind_rows('recorder_gap', 'e')} {in_window}) e"
    else:
        gaps = f"(SELECT e.* FROM events e {in_window} WHERE e.kind = 'recorder_gap') e"
    return f"sel AS (SELECT * FROM batches WHERE {where})", gaps, [v for _, v in bounds if v is not None]


def reported_losses(con: duckdb.DuckDBPyConnection, w: Window = Window(), *, kinds: bool | None = None) -> pl.DataFrame:
    """Per producer instance and reason: the events (and their page entries) its recorder reported lost in
    ``recorder_gap`` events of the batches that overlap the window, as :func:`coverage_gaps` counts them."""
    sel, gaps, params = gap_rows(con, w, kinds)
    rows = con.execute(
        f"""WITH {sel}, g AS (SELECT producer_id, gap_reason, sum(dropped_events) AS events,
                                   sum(coalesce(dropped_pages, 0)) AS pages FROM {gaps} GROUP BY ALL)
            SELECT p.node, p.instance, g.gap_reason, g.events::BIGINT, g.pages::BIGINT
            FROM g JOIN producers p USING (producer_id) WHERE g.events > 0 ORDER BY ALL""",
        params,
    ).fetchall()
    schema = {"node": pl.Utf8, "instance": pl.Utf8, "gap_reason": pl.Utf8, "events": pl.Int64, "pages": pl.Int64}
    return pl.DataFrame(rows, schema=schema, orient="row")


# How a recorder_gap's reason reads in a warning.
_LOSS_WORDS = {
    "buffer_full": "buffer full",
    "invalid": "refused as invalid",
    "encode_error": "not encodable",
    "writer_error": "store unreachable",
    "transport": "lost in transport",
    "hook_error": "engine hook failed",
}


def reported_loss_warning(losses: pl.DataFrame) -> str | None:
    """The coverage warning for :func:`reported_losses` (None when there are none)."""
    if losses.is_empty():
        return None
    per: dict[tuple[str, str], list[str]] = {}
    for node, instance, reason, events, _pages in losses.iter_rows():
        per.setdefault((node, instance), []).append(f"{events} {_LOSS_WORDS.get(reason, reason)}")
    shown = "; ".join(f"{n} ({i}): {', '.join(r)}" for (n, i), r in list(per.items())[:SHOWN_IDS])
    more = f"; and {len(per) - SHOWN_IDS} more producer(s)" if len(per) > SHOWN_IDS else ""
    return (
        f"coverage: recorders reported {int(losses['events'].sum())} event(s) lost before they were stored "
        f"({shown}{more}); what those events recorded cannot be checked, so findings may be missing and "
        "counts too low"
    )


def _ids(values: list) -> str:
    shown = ", ".join(str(v) for v in values[:SHOWN_IDS])
    return shown + (f" and {len(values) - SHOWN_IDS} more" if len(values) > SHOWN_IDS else "")


def shared_transfer_warning(shared: pl.DataFrame) -> str | None:
    """The integrity warning for :func:`shared_transfer_ids` (None when there are none)."""
    if shared.is_empty():
        return None
    tids = shared["transfer_id"].to_list()
    per = "; ".join(f"{t}: {_ids(r)}" for t, r in shared.head(SHOWN_IDS).select("transfer_id", "request_ids").rows())
    return (
        f"integrity: {len(tids)} transfer id(s) carried by more than one request ({per}"
        f"{'; ...' if len(tids) > SHOWN_IDS else ''}); their transfers are judged per request, "
        "but the producer's ids are suspect"
    )


def empty_after_abort_note(empty: pl.DataFrame) -> str | None:
    """The note for :func:`empty_after_abort` (None when there are none)."""
    if empty.is_empty():
        return None
    return (
        f"{len(empty)} response(s) got HTTP 2xx with no output after an abort (not F4, not exposure: "
        f"SGLang's abort-returns-200 pattern): {_ids(empty['request_id'].to_list())}"
    )


def unverified_landings(
    con: duckdb.DuckDBPyConnection, w: Window = Window(), *, kinds: bool | None = None
) -> pl.DataFrame:
    """Transfers decode committed without evidence of what landed (``transfer_received`` status
    ``unverified``), per (prefill node, decode node) pair: the prefill node from the transfer's sends
    (None: prefill recorded none), the number of transfers and of pages whose writer is unknown.
    ``kinds``: as for :func:`shared_transfer_ids`."""
    if has_kind_tables(con) if kinds is None else kinds:  # the receipts' own table, not the union
        where, params = kind_window_filter(w.from_ns, w.to_ns, "x")
        rec = (
            f"SELECT x.*, p.node FROM {kind_rows('transfer_received', 'x')} JOIN producers p "
            f"ON p.producer_id = x.producer_id WHERE {where} AND x.status = 'unverified'"
        )
        sends = (
            f"SELECT x.transfer_id, x.request_id, p.node FROM {kind_rows('transfer_sent', 'x')} "
            "JOIN producers p ON p.producer_id = x.producer_id"
        )
    else:
        ev, params = _windowed(w)
        rec = f"SELECT * FROM {ev} WHERE kind = 'transfer_received' AND status = 'unverified'"
        sends = "SELECT transfer_id, request_id, node FROM events_v WHERE kind = 'transfer_sent'"
    rows = con.execute(
        f"""
        WITH rec AS ({rec}),
             snd AS (SELECT transfer_id, request_id, min(node) AS node FROM ({sends})
                     WHERE (transfer_id, request_id) IN (SELECT (transfer_id, request_id) FROM rec) GROUP BY ALL)
        SELECT s.node, r.node, count(*), sum(r.num_pages)
        FROM rec r LEFT JOIN snd s ON s.transfer_id = r.transfer_id AND s.request_id = r.request_id
        GROUP BY ALL ORDER BY 2, 1 NULLS FIRST""",
        params,
    ).fetchall()
    return pl.DataFrame(
        [{"prefill_node": p, "decode_node": d, "transfers": n, "pages": int(pg or 0)} for p, d, n, pg in rows],
        schema={"prefill_node": pl.Utf8, "decode_node": pl.Utf8, "transfers": pl.Int64, "pages": pl.Int64},
    )


def unverified_landings_note(landings: pl.DataFrame) -> str | None:
    """The coverage note for :func:`unverified_landings` (None when there are none)."""
    if landings.is_empty():
        return None
    pairs = "; ".join(
        f"{p or '(no prefill record)'} -> {d}: {n} transfer(s), {pg} page(s)" for p, d, n, pg in landings.iter_rows()
    )
    return (
        "unverified landings (coverage): decode committed transfers it could not verify (its transfer "
        "metadata was not the request's: prefill without kvtrail's plugin, or another room's slot); their "
        f"pages' writer is unknown, a read of them is judged as of never-written pages: {pairs}"
    )


def window_ends(con: duckdb.DuckDBPyConnection, w: Window = Window(), *, kinds: bool | None = None) -> list[UncleanEnd]:
    """The unclean ends whose possible gap (after the last stored event, up to the bound) meets the window."""
    return [
        e
        for e in unclean_ends(con, kinds=kinds)
        if (w.to_ns is None or e.last_wall_ns <= w.to_ns)
        and (w.from_ns is None or e.gap_end_ns is None or e.gap_end_ns >= w.from_ns)
    ]


def incomplete_requests(con: duckdb.DuckDBPyConnection, w: Window, ends: list[UncleanEnd]) -> pl.DataFrame:
    """Requests in flight when a producer of their cluster ended uncleanly: (request_id, node, instance)
    of the producer whose lost tail they may lack."""
    schema = {"request_id": pl.Utf8, "node": pl.Utf8, "instance": pl.Utf8}
    if not ends:
        return pl.DataFrame(schema=schema)
    ev, params = _windowed(w)
    spans = con.execute(
        f"""SELECT request_id, cluster, min(wall_ns), max(wall_ns) FROM {ev}
                            WHERE request_id IS NOT NULL GROUP BY request_id, cluster""",
        params,
    ).fetchall()
    rows = []
    for e in ends:
        close = e.gap_end_ns
        rows += [
            {"request_id": rid, "node": e.node, "instance": e.instance}
            for rid, cluster, lo, hi in spans
            if cluster == e.cluster and hi > e.last_wall_ns and (close is None or lo <= close)
        ]
    return pl.DataFrame(rows, schema=schema).unique(maintain_order=True)


def withhold_incomplete(found: list[Finding], incomplete: pl.DataFrame) -> tuple[list[Finding], list[Finding]]:
    """(findings kept, transfer findings of incomplete requests withheld)."""
    ids = set(incomplete["request_id"].to_list())
    withheld = [f for f in found if f.code in INCOMPLETE_CODES and f.request_id in ids]
    return [f for f in found if not (f.code in INCOMPLETE_CODES and f.request_id in ids)], withheld


def unclean_end_warnings(ends: list[UncleanEnd], incomplete: pl.DataFrame, withheld: int = 0) -> tuple[str, ...]:
    """One coverage warning per unclean end, and one for the requests it leaves incomplete."""
    out = [f"coverage: {e}" for e in ends]
    if len(incomplete):
        ids = incomplete["request_id"].unique(maintain_order=True).to_list()
        out.append(
            f"coverage: {len(ids)} request(s) were in flight when a producer ended uncleanly and may lack "
            f"its events ({_ids(ids)}); their transfer findings (F2, F3) are withheld as incomplete"
            + (f" ({withheld} withheld)" if withheld else "")
        )
    return tuple(out)


def integrity_warnings(
    con: duckdb.DuckDBPyConnection,
    w: Window = Window(),
    *,
    ends: list[UncleanEnd] | None = None,
    incomplete: pl.DataFrame | None = None,
    withheld: int = 0,
    shared: pl.DataFrame | None = None,
    losses: pl.DataFrame | None = None,
) -> tuple[str, ...]:
    """The warnings every answer over the window carries: shared transfer ids, unclean ends and the
    requests they leave incomplete, events the recorders reported lost (``ends``/``incomplete``/``shared``/
    ``losses``: when the caller has them already; ``withheld``: how many findings the caller withheld for
    them)."""
    if ends is None:
        ends = window_ends(con, w)
    return warning_texts(
        shared_transfer_ids(con, w) if shared is None else shared,
        ends,
        incomplete_requests(con, w, ends) if incomplete is None else incomplete,
        withheld,
        reported_losses(con, w) if losses is None else losses,
    )


def warning_texts(
    shared: pl.DataFrame, ends: list[UncleanEnd], incomplete: pl.DataFrame, withheld: int, losses: pl.DataFrame
) -> tuple[str, ...]:
    """The warnings of :func:`integrity_warnings` from its pieces, in the order every answer and report
    gives them: shared transfer ids, unclean ends and what they leave incomplete, reported losses."""
    text = shared_transfer_warning(shared)
    lost = reported_loss_warning(losses)
    return ((text,) if text else ()) + unclean_end_warnings(ends, incomplete, withheld) + ((lost,) if lost else ())
