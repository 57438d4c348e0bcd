"""The query API: one route per forensics question, each calling the function the CLI calls.

Every route reads through a fresh cursor of the service's store (as the CLI reads a store file), is
bounded by ``from``/``to`` (ISO 8601 UTC) with the CLI's filters,
and is recorded in the access log (:mod:`kvtrail.service.audited`). Operators get everything; tenant
tokens get their own requests and counts (:mod:`kvtrail.answers.tenancy`); producer tokens get 403.
"""

# No "from __future__ import annotations": FastAPI must see the route-local Annotated aliases as objects.
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal, TypeVar

import duckdb
from fastapi import APIRouter, Depends, HTTPException, Path, Query, Response

from kvtrail.answers import pages, persisted, tenancy, transfers
from kvtrail.answers.client import NEXT_HEADER
from kvtrail.errors import KvtrailError
from kvtrail.forensics import (
    AFFECTED_CODES,
    Answer,
    Exclusions,
    ForensicsPolicy,
    ProbeRules,
    Window,
    ask_affected,
    ask_exploitation,
    ask_exposure,
    ask_findings,
    ask_node_configurations,
    ask_thresholds,
    coverage_gaps,
)
from kvtrail.forensics.options import ReportOptions
from kvtrail.forensics.questions import findings_of
from kvtrail.service import audit_api, model_api, models, tokens_api
from kvtrail.service.audited import logged_route
from kvtrail.service.auth import principal_dependency, require_role
from kvtrail.service.judged import affected_answer, findings_answer, judged_or_replayed
from kvtrail.service.reports import ReportBody, report_response
from kvtrail.service.responses import TABLE_CONTENT, answer_meta, table_response
from kvtrail.service.tokens import Principal
from kvtrail.timeutil import parse_utc

T = TypeVar("T")
Format = Literal["json", "csv", "parquet"]
IdReasons = Annotated[list[str], Query(description="ID[=REASON], repeatable: left out of every count.")]
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": models.ErrorBody, "description": "Bad parameter (named in the message)."},
    401: {"model": models.ErrorBody, "description": "Missing, unknown, revoked or expired token."},
    403: {"model": models.ErrorBody, "description": "The token's role may not ask this."},
}


@dataclass(frozen=True)
class Ask:
    """A request's window and output format, as the CLI's --from/--to/--tenant/--node/--format give them."""

    window: Window
    fmt: str


def _time(text: str | None, field: str) -> int | None:
    if text is None or text == "":
        return None
    try:
        return parse_utc(text, field=field)
    except KvtrailError as exc:
        raise HTTPException(400, str(exc)) from None


def ask_params(
    from_: Annotated[str | None, Query(alias="from", description="UTC start of the window (ISO 8601).")] = None,
    to: Annotated[str | None, Query(description="UTC end of the window (ISO 8601).")] = None,
    tenant: Annotated[str | None, Query(description="Only this tenant (as recipient or victim).")] = None,
    node: Annotated[str | None, Query(description="Only this node.")] = None,
    format: Annotated[Format, Query(description="json (rows), csv or parquet.")] = "json",
) -> Ask:
    return Ask(Window(_time(from_, "from"), _time(to, "to"), tenant or None, node or None), format)


def exclusions_params(
    exclude_tenant: IdReasons = [],  # noqa: B006
    exclude_api_key: IdReasons = [],  # noqa: B006
    exclude_request: IdReasons = [],  # noqa: B006
) -> Exclusions:
    def pairs(values: list[str], field: str) -> tuple[tuple[str, str], ...]:
        out: dict[str, str] = {}
        for v in values:
            key, _, reason = v.partition("=")
            if not key.strip():
                raise HTTPException(400, f"{field}: empty id in {v!r}")
            out.setdefault(key.strip(), reason.strip() or "excluded by the query")
        return tuple(sorted(out.items()))

    return Exclusions(
        pairs(exclude_tenant, "exclude_tenant"),
        pairs(exclude_api_key, "exclude_api_key"),
        pairs(exclude_request, "exclude_request"),
    )


def probe_params(
    baseline_from: str | None = None,
    baseline_to: str | None = None,
    long_prompt_tokens: Annotated[int | None, Query(ge=1, le=2**62)] = None,
    burst_minutes: Annotated[float, Query(gt=0, le=1e9)] = 10.0,
    burst_count: Annotated[int, Query(ge=1, le=2**31)] = 5,
) -> dict:
    return {
        "baseline_from": baseline_from,
        "baseline_to": baseline_to,
        "long_prompt_tokens": long_prompt_tokens,
        "burst_minutes": burst_minutes,
        "burst_count": burst_count,
    }


def report_options(from_ns: int | None, to_ns: int | None, excl: Exclusions, probe: dict) -> ReportOptions:
    """The CLI's report and exploitation options from HTTP parameters (400 naming the field)."""
    if from_ns is None or to_ns is None:
        raise HTTPException(400, f"{'from' if from_ns is None else 'to'}: required (the baseline needs a window)")
    if from_ns > to_ns:
        raise HTTPException(400, "from: is after to")
    o = ReportOptions(
        from_ns,
        to_ns,
        excl,
        _time(probe["baseline_from"], "baseline_from"),
        _time(probe["baseline_to"], "baseline_to"),
        probe["long_prompt_tokens"],
        ProbeRules(burst_minutes=probe["burst_minutes"], burst_count=probe["burst_count"]),
    )
    lo, hi = o.baseline
    if lo > hi or lo < 0:
        raise HTTPException(400, "baseline_from: is after the end of the baseline period (or before 1970)")
    return o


def tenant_window(who: Principal, ask: Ask, excl: Exclusions | None = None) -> Window:
    """The window a tenant may ask about: no other tenant, no node, no exclusions; its tenant filter is
    applied by :mod:`tenancy` on the answer (so no error can list the store's tenants)."""
    if ask.window.tenant not in (None, who.tenant_id):
        raise HTTPException(403, "tenant: a tenant token asks only about its own tenant")
    if ask.window.node is not None:
        raise HTTPException(403, "node: a tenant token cannot filter by node")
    if excl is not None and not excl.empty:
        raise HTTPException(403, "exclude_*: a tenant token cannot set exclusions")
    return replace(ask.window, tenant=None)


def _request_owner(cur: duckdb.DuckDBPyConnection, request_id: str, tenant_id: str | None) -> str | None:
    """The tenant of ``request_id``, if it has one (and, for a tenant asking, it is that tenant); else None."""
    row = cur.execute(
        "SELECT tenant_id FROM events_v WHERE request_id = ? AND tenant_id IS NOT NULL "
        "AND (? IS NULL OR tenant_id = ?) LIMIT 1",
        [request_id, tenant_id, tenant_id],
    ).fetchone()
    return None if row is None else row[0]


def router(state: Any) -> APIRouter:
    """The ``/v1`` query routes over ``state`` (a :class:`kvtrail.service.state.ServiceState`)."""
    r = APIRouter(prefix="/v1", route_class=logged_route(state), responses=ERRORS, tags=["queries"])
    Who = Annotated[Principal, Depends(principal_dependency(state))]
    AskQ = Annotated[Ask, Depends(ask_params)]
    Excl = Annotated[Exclusions, Depends(exclusions_params)]
    table: dict[int | str, dict[str, Any]] = {200: {"content": TABLE_CONTENT}}

    def run(who: Principal, fn: Callable[[duckdb.DuckDBPyConnection], T]) -> T:
        cur = state.cursor()
        try:
            return fn(cur)
        except (KvtrailError, ValueError) as exc:
            if who.role == "tenant":  # forensics messages may list the store's tenants or nodes
                raise HTTPException(400, "the query cannot be answered for these parameters") from None
            raise HTTPException(getattr(exc, "http_status", 400), str(exc)) from None
        finally:
            cur.close()

    def operator_only(who: Principal) -> None:
        require_role(who, "operator")

    @r.get("/affected", response_model=list[models.AffectedRow] | list[models.TenantAffectedRow], responses=table)
    def affected(who: Who, ask: AskQ, excl: Excl) -> Response:
        """Which responses read foreign pages in the window, and whose data it was (``kvtrail forensics affected``).
        A tenant gets its own affected responses, with other requests and tenants as counts."""
        require_role(who, "operator", "tenant")
        if who.role == "tenant":
            w = tenant_window(who, ask, excl)
            answer = run(
                who,
                lambda cur: judged_or_replayed(
                    cur,
                    state,
                    w,
                    lambda c, u, found, ctx: affected_answer(c, u, found, Exclusions(), ctx),
                    lambda c: ask_affected(c, w),
                    ("affected", Exclusions()),
                ),
            )
            return table_response(
                tenancy.tenant_affected(answer.rows, who.tenant_id or ""), ask.fmt, answer_meta(answer, tenant=True)
            )
        answer = run(
            who,
            lambda cur: judged_or_replayed(
                cur,
                state,
                ask.window,
                lambda c, u, found, ctx: affected_answer(c, u, found, excl, ctx),
                lambda c: ask_affected(c, ask.window, exclusions=excl),
                ("affected", excl),
            ),
        )
        return table_response(answer.rows, ask.fmt, answer_meta(answer, tenant=False))

    @r.get("/findings", response_model=list[models.FindingRow] | models.FindingsSince, responses=table)
    def findings(
        who: Who,
        ask: AskQ,
        excl: Excl,
        code: Annotated[list[str], Query(description="Only these codes (repeatable), e.g. F1.")] = [],  # noqa: B006
        engine: Literal["replay", "sql"] = "replay",
        allow_tenant_cache_sharing: bool = False,
        latency_factor: Annotated[float, Query(ge=1.0, le=1e9)] = ForensicsPolicy.latency_factor,
        since: Annotated[
            int | None,
            Query(
                ge=0,
                le=2**62,
                description="Persisted findings of judge runs after this cursor (the 'next' of the previous call).",
            ),
        ] = None,
    ) -> Response:
        """Every finding in the window with its evidence (``kvtrail forensics findings``); with ``since``, the
        findings the live judge persisted since that cursor and the cursor to follow them with."""
        operator_only(who)
        if since is not None:
            rows, nxt = run(who, lambda cur: persisted.persisted_since(cur, since, ask.window, tuple(code)))
            if ask.fmt == "json":
                body = models.FindingsSince.model_validate({"findings": rows.to_dicts(), "next": nxt})
                return Response(body.model_dump_json(), media_type="application/json")
            return table_response(rows, ask.fmt, {}, {NEXT_HEADER: str(nxt)})
        policy = ForensicsPolicy(allow_tenant_cache_sharing=allow_tenant_cache_sharing, latency_factor=latency_factor)

        def replayed(cur: duckdb.DuckDBPyConnection) -> Answer:
            return ask_findings(cur, ask.window, codes=tuple(code), engine=engine, policy=policy, exclusions=excl)

        if engine == "replay" and policy == state.judge.policy:  # what the judge found is what a replay finds
            answer = run(
                who,
                lambda cur: judged_or_replayed(
                    cur,
                    state,
                    ask.window,
                    lambda c, u, found, ctx: findings_answer(c, u, found, tuple(code), excl, ctx),
                    replayed,
                    ("findings", tuple(code), excl),
                ),
            )
        else:
            answer = run(who, replayed)
        return table_response(answer.rows, ask.fmt, answer_meta(answer, tenant=False))

    @r.get("/exposure", response_model=list[models.ExposureRow] | models.TenantExposure, responses=table)
    def exposure(who: Who, ask: AskQ, excl: Excl) -> Response:
        """Recipient tenant x victim tenant (``kvtrail forensics exposure``). A tenant learns whether its data was
        read, which of its requests, and by how many responses and other tenants."""
        require_role(who, "operator", "tenant")
        if who.role == "tenant":
            w = tenant_window(who, ask, excl)
            answer = run(who, lambda cur: ask_findings(cur, w, codes=tuple(sorted(AFFECTED_CODES))))
            body = models.TenantExposure(**tenancy.tenant_exposure(answer.rows, who.tenant_id or ""))
            return Response(body.model_dump_json(), media_type="application/json")
        answer = run(who, lambda cur: ask_exposure(cur, ask.window, exclusions=excl))
        return table_response(answer.rows, ask.fmt, answer_meta(answer, tenant=False))

    @r.get(
        "/requests/{request_id}",
        response_model=models.TenantRequest,
        responses={404: {"model": models.ErrorBody, "description": "No such request (or not the tenant's)."}},
    )
    def request(
        who: Who, ask: AskQ, request_id: Annotated[str, Path(min_length=1, max_length=1000)]
    ) -> models.TenantRequest:
        """One request's part in the window's findings. A tenant asking for a request that is not its own gets
        the same 404 as for one that does not exist."""
        require_role(who, "operator", "tenant")
        w = tenant_window(who, ask) if who.role == "tenant" else ask.window

        def answer(cur: duckdb.DuckDBPyConnection) -> dict | None:
            owner = _request_owner(cur, request_id, who.tenant_id)
            if owner is None:
                return None
            found = ask_findings(cur, w, codes=tuple(sorted(AFFECTED_CODES))).rows
            return tenancy.request_status(found, request_id, owner)

        status = run(who, answer)
        if status is None:
            raise HTTPException(404, "no such request")
        return models.TenantRequest(**status)

    @r.get(
        "/requests/{request_id}/pages",
        response_model=models.RequestPages,
        responses={404: {"model": models.ErrorBody, "description": "No such request (or not the tenant's)."}},
    )
    def request_pages(
        who: Who, ask: AskQ, request_id: Annotated[str, Path(min_length=1, max_length=1000)]
    ) -> models.RequestPages:
        """One request's page ownership timeline (who held, wrote and freed each page it read), its transfers,
        response and findings: the dashboard's drill-down. The window bounds the findings (its tenant and node
        filters do not apply). A tenant gets its own requests only (another's is the same 404 as none), with
        other requests, tenants and nodes as pseudonyms."""
        require_role(who, "operator", "tenant")
        w = tenant_window(who, ask) if who.role == "tenant" else ask.window
        span = Window(w.from_ns, w.to_ns)

        def answer(cur: duckdb.DuckDBPyConnection) -> dict | None:
            owner = _request_owner(cur, request_id, who.tenant_id)
            if owner is None:
                return None
            # as the --db dashboard does: a judge run (or --save) covering the window, else a replay
            saved = persisted.covering_run(cur, span.from_ns, span.to_ns) is not None
            every = (
                persisted.persisted_findings(cur, span.from_ns, span.to_ns) if saved else ask_findings(cur, span).found
            )
            found = [f for f in every if f.request_id == request_id]
            return pages.detail_document(pages.request_detail(cur, request_id, found))

        doc = run(who, answer)
        if doc is None:
            raise HTTPException(404, "no such request")
        if who.role == "tenant":
            doc = tenancy.tenant_request_pages(doc, who.tenant_id or "")
        return models.RequestPages(**doc)

    @r.get("/thresholds", response_model=list[models.ThresholdRow], responses=table)
    def thresholds(who: Who, ask: AskQ, excl: Excl) -> Response:
        """Pool vs advertised context per node, and prompts against the prefill pool (``kvtrail forensics
        thresholds``)."""
        operator_only(who)
        answer = run(who, lambda cur: ask_thresholds(cur, ask.window, exclusions=excl))
        return table_response(answer.rows, ask.fmt, answer_meta(answer, tenant=False))

    @r.get("/exploitation", response_model=list[models.ExploitationRow], responses=table)
    def exploitation(who: Who, ask: AskQ, excl: Excl, probe: Annotated[dict, Depends(probe_params)]) -> Response:
        """Per recipient tenant: over-long prompts vs its own baseline, bursts, a verdict (``kvtrail forensics
        exploitation``)."""
        operator_only(who)
        options = report_options(ask.window.from_ns, ask.window.to_ns, excl, probe)
        answer = run(who, lambda cur: ask_exploitation(cur, options, ask.window))
        return table_response(answer.rows, ask.fmt, answer_meta(answer, tenant=False))

    @r.get("/transfers", response_model=list[models.TransferRow], responses=table)
    def transfer_mismatches(who: Who, ask: AskQ) -> Response:
        """Length (F2) and digest (F3) mismatches with the prefill -> decode node pair each crossed (the
        dashboard's Transfers view)."""
        operator_only(who)
        rows = run(
            who, lambda cur: transfers.mismatches(cur, findings_of(cur, ask.window, codes=transfers.CODES), ask.window)
        )
        return table_response(rows, ask.fmt, {})

    @r.get("/nodes", response_model=list[models.NodeRow], responses=table)
    def nodes(who: Who, ask: AskQ) -> Response:
        """Each node's configuration in effect during the window: pool tokens vs advertised context, role."""
        operator_only(who)
        answer = run(who, lambda cur: ask_node_configurations(cur, ask.window))
        return table_response(answer.rows, ask.fmt, answer_meta(answer, tenant=False))

    @r.get("/coverage", response_model=list[models.CoverageRow], responses=table)
    def coverage(who: Who, ask: AskQ) -> Response:
        """Per producer: sequence numbers missing that no recorder_gap explains, among the batches whose events
        overlap the window (``from``/``to``; the whole store without them), optionally of one ``node``."""
        operator_only(who)
        gaps = run(who, lambda cur: coverage_gaps(cur, ask.window))
        if ask.window.node:
            gaps = gaps.filter(gaps["node"] == ask.window.node)
        return table_response(gaps, ask.fmt, {})

    @r.post(
        "/reports",
        responses={
            200: {
                "content": {
                    "application/zip": {"schema": {"type": "string", "format": "binary"}},
                    "application/gzip": {"schema": {"type": "string", "format": "binary"}},
                }
            }
        },
        response_class=Response,
    )
    def reports(who: Who, body: ReportBody) -> Response:
        """Run the disclosure report for a window and options; the archive (zip or tar.gz) of its files."""
        operator_only(who)
        options = report_options(
            _time(body.from_, "from"),
            _time(body.to, "to"),
            exclusions_params(body.exclude_tenant, body.exclude_api_key, body.exclude_request),
            body.probe(),
        )
        return run(who, lambda cur: report_response(cur, options, body, state.db_path.name))

    r.include_router(audit_api.router(state, logged_route(state), run))
    r.include_router(model_api.router(state, logged_route(state), run))
    r.include_router(tokens_api.router(state, logged_route(state)))
    return r
