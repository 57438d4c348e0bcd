"""The query API: one route per forensics question, each calling the function the CLI calls.

Every route reads through a fresh cursor of the service's store (as the CLI reads a store file), is
bounded by ``from``/``to`` (ISO 8601 UTC) with the CLI's filters,
and is recorded in the access log (:mod:`kvtrail.service.audited`). Operators get everything; tenant
tokens get their own requests and counts (:mod:`kvtrail.answers.tenancy`); producer tokens get 403.
"""

# No "from __future__ import annotations": FastAPI must see the route-local Annotated aliases as objects.
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Annotated, Any, Literal, TypeVar

import duckdb
from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request, Response

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
from kvtrail.service.auth import current_principal, require_role
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


def service_state(request: Request) -> Any:
    """The :class:`~kvtrail.service.state.ServiceState` the application serves (``create_app`` sets it)."""
    return request.app.state.kvtrail


State = Annotated[Any, Depends(service_state)]
Who = Annotated[Principal, Depends(current_principal)]
AskQ = Annotated[Ask, Depends(ask_params)]
Excl = Annotated[Exclusions, Depends(exclusions_params)]
RequestId = Annotated[str, Path(min_length=1, max_length=1000)]
Codes = Annotated[list[str], Query(description="Only these codes (repeatable), e.g. F1.")]
Since = Annotated[
    int | None,
    Query(
        ge=0,
        le=2**62,
        description="Persisted findings of judge runs after this cursor (the 'next' of the previous call).",
    ),
]
Probe = Annotated[dict, Depends(probe_params)]
TABLE: dict[int | str, dict[str, Any]] = {200: {"content": TABLE_CONTENT}}
NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": models.ErrorBody, "description": "No such request (or not the tenant's)."},
    409: {"model": models.ErrorBody, "description": "Requests of different tenants share the id: add tenant=."},
}
ARCHIVE: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {
            "application/zip": {"schema": {"type": "string", "format": "binary"}},
            "application/gzip": {"schema": {"type": "string", "format": "binary"}},
        }
    }
}


def run(state: Any, who: Principal, fn: Callable[[duckdb.DuckDBPyConnection], T]) -> T:
    """``fn`` on a fresh cursor of the store; a forensics error becomes a 4xx (a tenant's without its text,
    which may list the store's tenants or nodes)."""
    cur = state.cursor()
    try:
        return fn(cur)
    except (KvtrailError, ValueError) as exc:
        if who.role == "tenant":
            raise HTTPException(400, "the query cannot be answered for these parameters") from None
        raise HTTPException(getattr(exc, "http_status", 400), str(exc)) from None
    finally:
        cur.close()


def _affected_of(state: Any, w: Window, excl: Exclusions, cur: duckdb.DuckDBPyConnection) -> Answer:
    """``ask_affected`` for ``w``: from what the live judge found when it covers ``w``, else a replay."""

    def judged(c: duckdb.DuckDBPyConnection, u: Window, found: list, ctx: Any) -> Answer:
        return affected_answer(c, u, found, excl, ctx)

    def replayed(c: duckdb.DuckDBPyConnection) -> Answer:
        return ask_affected(c, w, exclusions=excl)

    return judged_or_replayed(cur, state, w, judged, replayed, ("affected", excl))


def _findings_of(
    state: Any, w: Window, codes: tuple[str, ...], excl: Exclusions, cur: duckdb.DuckDBPyConnection
) -> Answer:
    """``ask_findings`` (replay engine, the judge's policy) for ``w``: judged when the judge covers ``w``."""

    def judged(c: duckdb.DuckDBPyConnection, u: Window, found: list, ctx: Any) -> Answer:
        return findings_answer(c, u, found, codes, excl, ctx)

    def replayed(c: duckdb.DuckDBPyConnection) -> Answer:
        return ask_findings(c, w, codes=codes, exclusions=excl)

    return judged_or_replayed(cur, state, w, judged, replayed, ("findings", codes, excl))


def affected(state: State, who: Who, ask: AskQ, excl: Excl) -> Response:
    """Which responses read foreign pages in the window, and whose data it was (``kvtrail forensics affected``).
    A tenant gets its own affected responses, with other requests and tenants as counts."""
    require_role(who, "operator", "tenant")
    if who.role == "tenant":
        w = tenant_window(who, ask, excl)
        answer = run(state, who, partial(_affected_of, state, w, Exclusions()))
        rows = tenancy.tenant_affected(answer.rows, who.tenant_id or "")
        return table_response(rows, ask.fmt, answer_meta(answer, tenant=True))
    answer = run(state, who, partial(_affected_of, state, ask.window, excl))
    return table_response(answer.rows, ask.fmt, answer_meta(answer, tenant=False))


def _findings_since(state: Any, who: Principal, ask: Ask, codes: tuple[str, ...], since: int) -> Response:
    rows, nxt = run(state, who, lambda cur: persisted.persisted_since(cur, since, ask.window, codes))
    if ask.fmt == "json":
        body = models.FindingsSince.model_validate({"findings": rows.to_dicts(), "next": nxt})
        return Response(body.model_dump_json(), media_type="application/json")
    return table_response(rows, ask.fmt, {}, {NEXT_HEADER: str(nxt)})


def findings(
    state: State,
    who: Who,
    ask: AskQ,
    excl: Excl,
    code: Codes = [],  # noqa: B006
    engine: Literal["replay", "sql"] = "replay",
    allow_tenant_cache_sharing: bool = False,
    latency_factor: Annotated[float, Query(ge=1.0, le=1e9)] = ForensicsPolicy.latency_factor,
    since: Since = None,
) -> Response:
    """Every finding in the window with its evidence (``kvtrail forensics findings``); with ``since``, the
    findings the live judge persisted since that cursor and the cursor to follow them with."""
    require_role(who, "operator")
    codes = tuple(code)
    if since is not None:
        return _findings_since(state, who, ask, codes, since)
    policy = ForensicsPolicy(allow_tenant_cache_sharing=allow_tenant_cache_sharing, latency_factor=latency_factor)
    if engine == "replay" and policy == state.judge.policy:  # what the judge found is what a replay finds
        answer = run(state, who, partial(_findings_of, state, ask.window, codes, excl))
    else:
        answer = run(
            state,
            who,
            lambda cur: ask_findings(cur, ask.window, codes=codes, engine=engine, policy=policy, exclusions=excl),
        )
    return table_response(answer.rows, ask.fmt, answer_meta(answer, tenant=False))


def exposure(state: State, who: Who, ask: AskQ, excl: Excl) -> Response:
    """Recipient tenant x victim tenant (``kvtrail forensics exposure``). A tenant learns whether its data was
    read, which of its requests, and by how many responses and other tenants."""
    require_role(who, "operator", "tenant")
    if who.role == "tenant":
        w = tenant_window(who, ask, excl)
        answer = run(state, who, lambda cur: ask_findings(cur, w, codes=tuple(sorted(AFFECTED_CODES))))
        body = models.TenantExposure(**tenancy.tenant_exposure(answer.rows, who.tenant_id or ""))
        return Response(body.model_dump_json(), media_type="application/json")
    answer = run(state, who, lambda cur: ask_exposure(cur, ask.window, exclusions=excl))
    return table_response(answer.rows, ask.fmt, answer_meta(answer, tenant=False))


def _one_request(
    who: Principal, tenant: str | None, request_id: str, cur: duckdb.DuckDBPyConnection
) -> tuple[str, bool]:
    """(its tenant, whether another tenant's request shares the id) of the request ``request_id`` names: a
    tenant's own only (another's is the same 404 as none); an operator's, of ``tenant`` when the id is shared
    (else a 409 listing each request of that id)."""
    every = pages.request_keys(cur, request_id)
    mine = [k for k in every if k.tenant_id == (who.tenant_id if who.role == "tenant" else tenant or k.tenant_id)]
    if not mine:
        raise HTTPException(404, "no such request")
    if len(mine) > 1:
        named = "; ".join(f"tenant {k.tenant_id} (first event {k.first_producer}#{k.first_seq})" for k in mine)
        raise HTTPException(
            409, f"request_id: {len(mine)} requests of different tenants share it: {named}; add tenant="
        )
    return mine[0].tenant_id, len(every) > 1


def _request_status(
    who: Principal, w: Window, tenant: str | None, request_id: str, cur: duckdb.DuckDBPyConnection
) -> dict:
    owner, _ = _one_request(who, tenant, request_id, cur)
    found = ask_findings(cur, w, codes=tuple(sorted(AFFECTED_CODES))).rows
    return tenancy.request_status(found, request_id, owner)


def request(state: State, who: Who, ask: AskQ, request_id: RequestId) -> models.TenantRequest:
    """One request's part in the window's findings. A tenant asking for a request that is not its own gets
    the same 404 as for one that does not exist. Requests of two tenants may share an id: a tenant gets its
    own; an operator names the tenant (``tenant=``), else a 409 lists them."""
    require_role(who, "operator", "tenant")
    w = tenant_window(who, ask) if who.role == "tenant" else ask.window
    return models.TenantRequest(**run(state, who, partial(_request_status, who, w, ask.window.tenant, request_id)))


def _request_document(
    who: Principal, span: Window, tenant: str | None, request_id: str, cur: duckdb.DuckDBPyConnection
) -> tuple[dict, bool]:
    owner, shared = _one_request(who, tenant, request_id, cur)
    # as the --db dashboard does: a judge run (or --save) covering the window, else a replay
    saved = persisted.covering_run(cur, span.from_ns, span.to_ns) is not None
    every = persisted.persisted_findings(cur, span.from_ns, span.to_ns) if saved else ask_findings(cur, span).found
    found = [f for f in every if f.request_id == request_id and (f.tenant_id == owner or not (shared or f.tenant_id))]
    return pages.detail_document(pages.request_detail(cur, request_id, found, owner)), shared


def request_pages(state: State, who: Who, ask: AskQ, request_id: RequestId) -> models.RequestPages:
    """One request's page ownership timeline (who held, wrote and freed each page it read), its transfers,
    response and findings: the dashboard's drill-down. The window bounds the findings (its tenant and node
    filters do not apply; ``tenant`` chooses between requests of two tenants that share the id, else a 409
    lists them). A tenant gets its own requests only (another's is the same 404 as none, a request of another
    tenant with the same id is not shown), with other requests, tenants and nodes as pseudonyms."""
    require_role(who, "operator", "tenant")
    w = tenant_window(who, ask) if who.role == "tenant" else ask.window
    span = Window(w.from_ns, w.to_ns)
    doc, shared = run(state, who, partial(_request_document, who, span, ask.window.tenant, request_id))
    if who.role == "tenant":
        doc = tenancy.tenant_request_pages(doc, who.tenant_id or "", shared)
    return models.RequestPages(**doc)


def thresholds(state: State, who: Who, ask: AskQ, excl: Excl) -> Response:
    """Pool vs advertised context per node, and prompts against the prefill pool (``kvtrail forensics
    thresholds``)."""
    require_role(who, "operator")
    answer = run(state, who, lambda cur: ask_thresholds(cur, ask.window, exclusions=excl))
    return table_response(answer.rows, ask.fmt, answer_meta(answer, tenant=False))


def exploitation(state: State, who: Who, ask: AskQ, excl: Excl, probe: Probe) -> Response:
    """Per recipient tenant: over-long prompts vs its own baseline, bursts, a verdict (``kvtrail forensics
    exploitation``)."""
    require_role(who, "operator")
    options = report_options(ask.window.from_ns, ask.window.to_ns, excl, probe)
    answer = run(state, who, lambda cur: ask_exploitation(cur, options, ask.window))
    return table_response(answer.rows, ask.fmt, answer_meta(answer, tenant=False))


def _mismatches(w: Window, cur: duckdb.DuckDBPyConnection) -> Any:
    return transfers.mismatches(cur, findings_of(cur, w, codes=transfers.CODES), w)


def transfer_mismatches(state: State, who: Who, ask: AskQ) -> Response:
    """Length (F2) and digest (F3) mismatches with the prefill -> decode node pair each crossed (the
    dashboard's Transfers view)."""
    require_role(who, "operator")
    return table_response(run(state, who, partial(_mismatches, ask.window)), ask.fmt, {})


def nodes(state: State, who: Who, ask: AskQ) -> Response:
    """Each node's configuration in effect during the window: pool tokens vs advertised context, role."""
    require_role(who, "operator")
    answer = run(state, who, lambda cur: ask_node_configurations(cur, ask.window))
    return table_response(answer.rows, ask.fmt, answer_meta(answer, tenant=False))


def coverage(state: State, who: Who, ask: AskQ) -> Response:
    """Per producer: sequence numbers missing that no recorder_gap explains, among the batches whose events
    overlap the window (``from``/``to``; the whole store without them), optionally of one ``node``."""
    require_role(who, "operator")
    gaps = run(state, who, lambda cur: coverage_gaps(cur, ask.window))
    if ask.window.node:
        gaps = gaps.filter(gaps["node"] == ask.window.node)
    return table_response(gaps, ask.fmt, {})


def reports(state: State, who: Who, body: ReportBody) -> Response:
    """Run the disclosure report for a window and options; the archive (zip or tar.gz) of its files."""
    require_role(who, "operator")
    options = report_options(
        _time(body.from_, "from"),
        _time(body.to, "to"),
        exclusions_params(body.exclude_tenant, body.exclude_api_key, body.exclude_request),
        body.probe(),
    )
    return run(state, who, lambda cur: report_response(cur, options, body, state.db_path.name))


def router(state: Any) -> APIRouter:
    """The ``/v1`` query routes over ``state`` (a :class:`kvtrail.service.state.ServiceState`)."""
    r = APIRouter(prefix="/v1", route_class=logged_route(state), responses=ERRORS, tags=["queries"])
    tables: tuple[tuple[str, Callable[..., Response], Any], ...] = (
        ("/affected", affected, list[models.AffectedRow] | list[models.TenantAffectedRow]),
        ("/findings", findings, list[models.FindingRow] | models.FindingsSince),
        ("/exposure", exposure, list[models.ExposureRow] | models.TenantExposure),
    )
    for path, endpoint, model in tables:
        r.add_api_route(path, endpoint, methods=["GET"], response_model=model, responses=TABLE)
    r.add_api_route("/requests/{request_id}", request, response_model=models.TenantRequest, responses=NOT_FOUND)
    r.add_api_route(
        "/requests/{request_id}/pages", request_pages, response_model=models.RequestPages, responses=NOT_FOUND
    )
    tables = (
        ("/thresholds", thresholds, list[models.ThresholdRow]),
        ("/exploitation", exploitation, list[models.ExploitationRow]),
        ("/transfers", transfer_mismatches, list[models.TransferRow]),
        ("/nodes", nodes, list[models.NodeRow]),
        ("/coverage", coverage, list[models.CoverageRow]),
    )
    for path, endpoint, model in tables:
        r.add_api_route(path, endpoint, methods=["GET"], response_model=model, responses=TABLE)
    r.add_api_route("/reports", reports, methods=["POST"], responses=ARCHIVE, response_class=Response)
    r.include_router(audit_api.router(state, logged_route(state), partial(run, state)))
    r.include_router(model_api.router(state, logged_route(state), partial(run, state)))
    r.include_router(tokens_api.router(state, logged_route(state)))
    return r
