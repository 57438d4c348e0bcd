"""The engine's own integrity signals, held as evidence beside kvtrail's findings (docs/findings.md).

Three signals SGLang emits and the adapter records:

* **KV canary violations** (``kv_canary_violation``): SGLang's canary found a token slot whose side record
  does not match its position or chain. The engine names a slot, not a request: the violation is
  attributed to the request that last took its page on that producer before it (``pages_allocated``),
  unless the page was returned to the pool in between (then no request held it: ``request_id`` null).
  It concerns F1 and F5 (a read of pages the reader did not write).
* **Digested tokens differing from the reservation**: a receipt or a send whose digest covers
  (``digest_tokens``) another number of tokens than decode reserved for the transfer
  (``transfer_reserved``). The incident's shape is exactly that: a digest that matches proves the
  pages it covered, not the reserved pages it did not. Concerns F2 and F3; a matching digest there is
  never read as clean.
* **Speculative-decoding acceptance collapse**: a response whose draft acceptance rate
  (``spec_accepted_drafts / spec_proposed_drafts``) is below a threshold over at least a number of
  verification passes. Off by default (:class:`SignalPolicy`): acceptance varies with the prompt and the
  draft model, so a low rate alone is a weak, noisy signal. Concerns any finding of the response.

A signal is never a finding code: the replay and SQL engines do not see it, so they keep agreeing. Where
a finding of the same request has one of the codes a signal concerns, the signal is named beside it as
corroborating evidence; where none does, it is listed on its own, as a symptom to investigate.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import polars as pl

from kvtrail.audit.layout import has_kind_tables, kind_rows, table_name
from kvtrail.forensics.findings import Finding
from kvtrail.forensics.sql.joins import TRANSFER_CTES
from kvtrail.forensics.window import Window

CANARY, DIGEST_TOKENS, SPEC_ACCEPTANCE = "kv_canary_violation", "digest_tokens_differ", "spec_acceptance_low"
# The finding codes each signal corroborates (None: any finding of the request).
CONCERNS: dict[str, frozenset[str] | None] = {
    CANARY: frozenset({"F1", "F5"}),
    DIGEST_TOKENS: frozenset({"F2", "F3"}),
    SPEC_ACCEPTANCE: None,
}
SHOWN = 5
SCHEMA: dict[str, pl.DataType] = {
    "signal": pl.Utf8(),
    "node": pl.Utf8(),
    "request_id": pl.Utf8(),
    "tenant_id": pl.Utf8(),
    "wall_ns": pl.Int64(),
    "detail": pl.Utf8(),
    "evidence": pl.List(pl.List(pl.Int64())),
}


@dataclass(frozen=True)
class SignalPolicy:
    """Thresholds of the signals that need one. ``spec_min_accept_rate`` None: acceptance collapse is not
    judged (the default); else a response whose rate is below it over at least ``spec_min_verify_steps``
    verification passes is a symptom."""

    spec_min_accept_rate: float | None = None
    spec_min_verify_steps: int = 8

    def __post_init__(self):
        if self.spec_min_accept_rate is not None and not 0.0 < self.spec_min_accept_rate <= 1.0:
            raise ValueError("spec_min_accept_rate: must be in (0, 1]")
        if self.spec_min_verify_steps < 1:
            raise ValueError("spec_min_verify_steps: must be >= 1")


def _in_window(w: Window, col: str = "wall_ns") -> tuple[str, list]:
    where, params = ["TRUE"], []
    if w.from_ns is not None:
        where.append(f"{col} >= ?")
        params.append(w.from_ns)
    if w.to_ns is not None:
        where.append(f"{col} <= ?")
        params.append(w.to_ns)
    return " AND ".join(where), params


def _any(con: duckdb.DuckDBPyConnection, kinds: tuple[str, ...], cond: str, w: Window) -> bool:
    """Whether an event of ``kinds`` in the window meets ``cond``: each kind's own table where the store has
    them (the ``events`` union binds every kind), else the wide ``events`` (a lake)."""
    where, params = _in_window(w)
    if has_kind_tables(con):
        sql = " UNION ALL ".join(f"SELECT 1 FROM {table_name(k)} WHERE {cond} AND {where}" for k in kinds)
        params = params * len(kinds)
    else:
        listed = ", ".join(f"'{k}'" for k in kinds)
        sql = f"SELECT 1 FROM events WHERE kind IN ({listed}) AND {cond} AND {where}"
    row = con.execute(f"SELECT EXISTS ({sql})", params).fetchone()
    return bool(row and row[0])


def canary_violations(con: duckdb.DuckDBPyConnection, w: Window = Window()) -> pl.DataFrame:
    """The window's canary violations, each with the request that held its page then (if one did)."""
    if not _any(con, (CANARY,), "TRUE", w):
        return pl.DataFrame(schema=SCHEMA)
    where, params = _in_window(w)
    # the allocations and returns of pages: their own tables where the store has them (not the whole union)
    if has_kind_tables(con):
        holders = (
            "("
            + " UNION ALL ".join(
                f"SELECT '{k}' AS kind, x.producer_id, x.seq, x.request_id, x.tenant_id FROM {kind_rows(k, 'x')}"
                for k in ("pages_allocated", "pages_freed")
            )
            + ")"
        )
    else:
        holders = "(SELECT * FROM events WHERE kind IN ('pages_allocated', 'pages_freed'))"
    rows = con.execute(
        f"""
        WITH v AS (SELECT e.producer_id, e.seq, e.wall_ns, e.node, e.canary_slot, e.canary_position, e.canary_tag,
                          e.canary_reason, r.page_start AS page
                   FROM events_v e JOIN page_runs r ON r.producer_id = e.producer_id AND r.seq = e.seq AND r.list = 0
                   WHERE e.kind = '{CANARY}' AND {where}),
             runs AS (SELECT r.producer_id, r.seq, v.seq AS vseq, v.page
                      FROM v JOIN page_runs r ON r.producer_id = v.producer_id AND r.list = 0 AND r.seq < v.seq
                       AND v.page >= r.page_start AND v.page < r.page_start + r.num_pages),
             touched AS (SELECT x.producer_id, x.vseq, e.seq, e.kind, e.request_id, e.tenant_id
                         FROM runs x JOIN {holders} e ON e.producer_id = x.producer_id AND e.seq = x.seq),
             last AS (SELECT producer_id, vseq, arg_max(kind, seq) AS kind, arg_max(request_id, seq) AS request_id,
                             arg_max(tenant_id, seq) AS tenant_id, max(seq) AS seq
                      FROM touched GROUP BY producer_id, vseq)
        SELECT v.node, CASE WHEN l.kind = 'pages_allocated' THEN l.request_id END,
               CASE WHEN l.kind = 'pages_allocated' THEN l.tenant_id END, v.wall_ns, v.page, v.canary_slot,
               v.canary_position, v.canary_tag, v.canary_reason, v.producer_id, v.seq, l.seq
        FROM v LEFT JOIN last l ON l.producer_id = v.producer_id AND l.vseq = v.seq
        ORDER BY v.wall_ns, v.node, v.seq""",
        params,
    ).fetchall()
    out = []
    for node, rid, tenant, ns, page, slot, pos, tag, reason, pid, seq, held_seq in rows:
        at = f" position {pos}" if pos is not None else ""
        holder = f"held by {rid}" if rid is not None else "held by no request (free, or never allocated)"
        evidence = [[pid, seq]] + ([[pid, held_seq]] if rid is not None else [])
        detail = f"page {page} slot {slot}{at}: {tag} {reason}; {holder}"
        out.append(dict(signal=CANARY, node=node, request_id=rid, tenant_id=tenant, wall_ns=ns, detail=detail,
                        evidence=evidence))  # fmt: skip
    return pl.DataFrame(out, schema=SCHEMA)


def digest_token_differences(con: duckdb.DuckDBPyConnection, w: Window = Window()) -> pl.DataFrame:
    """Transfers with a digest whose covered tokens differ from what decode reserved: one row per transfer,
    naming both sides' digested tokens and whether the digests matched."""
    if not _any(con, ("transfer_sent", "transfer_received"), "digest_tokens IS NOT NULL", w):
        return pl.DataFrame(schema=SCHEMA)
    where, params = _in_window(w)
    # A transfer's events as the engines join them (``TRANSFER_CTES``: a bootstrap room's prefill send under
    # prefill's own request id is decode's request's), for the transfer ids of the window's digests.
    rows = con.execute(
        f"""
        WITH ev AS (SELECT producer_id, seq, kind, node, cluster, wall_ns, transfer_id, request_id,
                           request_id AS rid_text, tenant_id, num_tokens, digest, digest_tokens
                    FROM events_v
                    WHERE kind IN ('transfer_reserved', 'transfer_sent', 'transfer_received')
                      AND transfer_id IN (SELECT transfer_id FROM events_v
                                          WHERE kind IN ('transfer_sent', 'transfer_received')
                                            AND digest_tokens IS NOT NULL AND {where})),
             {TRANSFER_CTES},
             d AS (SELECT producer_id, seq, kind, node, wall_ns, transfer_id, treq AS request_id, tenant_id, digest,
                          digest_tokens
                   FROM txk WHERE kind IN ('transfer_sent', 'transfer_received') AND digest_tokens IS NOT NULL
                    AND {where}),
             keys AS (SELECT DISTINCT transfer_id, request_id FROM d),
             res AS (SELECT e.transfer_id, e.treq AS request_id, arg_max(e.num_tokens, e.wall_ns) AS reserved,
                            arg_max(e.node, e.wall_ns) AS node, arg_max(e.producer_id, e.wall_ns) AS pid,
                            arg_max(e.seq, e.wall_ns) AS seq
                     FROM txk e SEMI JOIN keys k ON k.transfer_id = e.transfer_id AND k.request_id = e.treq
                     WHERE e.kind = 'transfer_reserved' GROUP BY ALL),
             sent AS (SELECT transfer_id, request_id, arg_max(digest, wall_ns) AS digest,
                             arg_max(digest_tokens, wall_ns) AS tokens, arg_max([producer_id, seq], wall_ns) AS ev
                      FROM d WHERE kind = 'transfer_sent' GROUP BY ALL),
             recv AS (SELECT transfer_id, request_id, arg_max(digest, wall_ns) AS digest,
                             arg_max(digest_tokens, wall_ns) AS tokens, arg_max([producer_id, seq], wall_ns) AS ev,
                             any_value(tenant_id) AS tenant_id, max(wall_ns) AS wall_ns
                      FROM d WHERE kind = 'transfer_received' GROUP BY ALL)
        SELECT r.transfer_id, r.request_id, coalesce(rv.tenant_id, (SELECT any_value(tenant_id) FROM d
                 WHERE d.transfer_id = r.transfer_id AND d.request_id = r.request_id)), r.node, r.reserved,
               s.tokens, rv.tokens, s.digest, rv.digest, coalesce(rv.wall_ns, 0), [r.pid, r.seq], s.ev, rv.ev
        FROM res r LEFT JOIN sent s USING (transfer_id, request_id) LEFT JOIN recv rv USING (transfer_id, request_id)
        WHERE (s.tokens IS NOT NULL AND s.tokens <> r.reserved) OR (rv.tokens IS NOT NULL AND rv.tokens <> r.reserved)
        ORDER BY r.transfer_id, r.request_id""",
        params + params,
    ).fetchall()
    out = []
    for tid, rid, tenant, node, reserved, s_tok, r_tok, s_dg, r_dg, ns, res_ev, s_ev, r_ev in rows:
        if s_dg is None or r_dg is None:
            match = "one side's digest is not recorded"
        elif s_dg == r_dg:
            match = "the digests match: they prove the digested tokens only, not the rest of the reservation"
        else:
            match = "the digests differ"
        detail = (
            f"transfer {tid}: decode reserved {reserved} tokens; prefill's digest covers "
            f"{_tokens(s_tok)}, decode's {_tokens(r_tok)}; {match}"
        )
        evidence = [e for e in (res_ev, s_ev, r_ev) if e is not None]
        out.append(dict(signal=DIGEST_TOKENS, node=node, request_id=rid, tenant_id=tenant, wall_ns=ns, detail=detail,
                        evidence=evidence))  # fmt: skip
    return pl.DataFrame(out, schema=SCHEMA)


def _tokens(n: int | None) -> str:
    return f"{n} tokens" if n is not None else "(not recorded)"


def spec_acceptance(
    con: duckdb.DuckDBPyConnection, w: Window = Window(), policy: SignalPolicy = SignalPolicy()
) -> pl.DataFrame:
    """Responses whose speculative-decoding acceptance rate is below the policy's threshold (none when off)."""
    if policy.spec_min_accept_rate is None:
        return pl.DataFrame(schema=SCHEMA)
    if not _any(con, ("response_sent",), "spec_proposed_drafts > 0", w):
        return pl.DataFrame(schema=SCHEMA)
    where, params = _in_window(w)
    rows = con.execute(
        f"""SELECT node, request_id, tenant_id, wall_ns, spec_accepted_drafts, spec_proposed_drafts,
                   spec_verify_steps, completion_tokens, producer_id, seq
            FROM events_v WHERE kind = 'response_sent' AND spec_proposed_drafts > 0 AND spec_verify_steps >= ?
             AND spec_accepted_drafts < ? * spec_proposed_drafts AND {where}
            ORDER BY wall_ns, request_id""",
        [policy.spec_min_verify_steps, policy.spec_min_accept_rate, *params],
    ).fetchall()
    out = []
    for node, rid, tenant, ns, acc, prop, steps, completion, pid, seq in rows:
        detail = (
            f"speculative acceptance rate {acc / prop:.2f} ({acc}/{prop} drafts) below "
            f"{policy.spec_min_accept_rate:.2f}; acceptance length {completion / steps:.2f} over {steps} passes"
        )
        out.append(dict(signal=SPEC_ACCEPTANCE, node=node, request_id=rid, tenant_id=tenant, wall_ns=ns,
                        detail=detail, evidence=[[pid, seq]]))  # fmt: skip
    return pl.DataFrame(out, schema=SCHEMA)


def engine_signals(
    con: duckdb.DuckDBPyConnection, w: Window = Window(), policy: SignalPolicy = SignalPolicy()
) -> pl.DataFrame:
    """Every engine signal of the window (columns :data:`SCHEMA`), in time order; the window's tenant and
    node filters applied."""
    df = pl.concat([canary_violations(con, w), digest_token_differences(con, w), spec_acceptance(con, w, policy)])
    if w.tenant:
        df = df.filter(pl.col("tenant_id") == w.tenant)
    if w.node:
        df = df.filter(pl.col("node") == w.node)
    return df.sort("wall_ns", maintain_order=True)


def corroborated(signal: str, request_id: str | None, found: list[Finding] | tuple[Finding, ...]) -> list[str]:
    """The codes of the request's findings the signal corroborates (sorted; empty: it stands alone)."""
    if request_id is None:
        return []
    concerns = CONCERNS[signal]
    return sorted({f.code for f in found if f.request_id == request_id and (concerns is None or f.code in concerns)})


def signal_notes(signals: pl.DataFrame, found: list[Finding] | tuple[Finding, ...]) -> tuple[str, ...]:
    """One note per signal kind present: those that corroborate a finding of their request (named with its
    codes), and those no rule fired for (symptoms on their own)."""
    notes = []
    for name in (CANARY, DIGEST_TOKENS, SPEC_ACCEPTANCE):
        rows = signals.filter(pl.col("signal") == name)
        if rows.is_empty():
            continue
        beside: list[str] = []
        alone: list[str] = []
        for rid, detail in rows.select("request_id", "detail").iter_rows():
            codes = corroborated(name, rid, found)
            (beside if codes else alone).append(f"{rid} ({'/'.join(codes)}): {detail}" if codes else f"{rid}: {detail}")
        parts = []
        if beside:
            parts.append(f"beside findings: {_listed(beside)}")
        if alone:
            parts.append(f"no finding fired for {len(alone)} (a symptom to investigate): {_listed(alone)}")
        notes.append(f"engine signal {name} x{len(rows)}: " + "; ".join(parts))
    return tuple(notes)


def _listed(items: list[str]) -> str:
    return "; ".join(items[:SHOWN]) + (f"; and {len(items) - SHOWN} more" if len(items) > SHOWN else "")
