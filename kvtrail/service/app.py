"""The service's FastAPI application: ingest, the query API, ``/healthz``, and one error handler.

Every :class:`~kvtrail.errors.KvtrailError` a route raises becomes JSON with the error's own HTTP
status: a :class:`~kvtrail.errors.ValidationError` is 422 ``{"errors": [{event, kind, field, reason}]}``
(the ingest contract), any other ``{"detail": "..."}``. ``/openapi.json`` describes every route with
its response models.
"""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from kvtrail import __version__
from kvtrail.alerts import CONTENT_TYPE, exposition, registry_for
from kvtrail.errors import KvtrailError, ValidationError
from kvtrail.service import ingest, queries
from kvtrail.service.auth import authenticate_request, bearer, require_role
from kvtrail.service.config import DEFAULT_MAX_BODY_BYTES
from kvtrail.service.state import ServiceState


class Health(BaseModel):
    """Liveness and the writer's and judge's counters (no auth: nothing in it names a tenant or request)."""

    status: str
    version: str
    uptime_s: float
    committed_batches: int
    committed_events: int
    commit_transactions: int  # batches of different producers that arrive together share one
    duplicate_batches: int
    checkpoints: int  # WAL checkpoints of the store since the service started, and their time
    checkpoint_s: float
    judge_polls: int
    judge_failures: int
    judge_lag_p50_s: float | None  # commit -> findings persisted, over the judge's latest polls
    judge_lag_p99_s: float | None
    judge_cpu_s: float  # CPU seconds the live judge's thread has spent judging commits since the service started


def create_app(
    state: ServiceState, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, metrics_token: bool = False
) -> FastAPI:
    """The application serving ``state``'s store; ``metrics_token``: ``/metrics`` needs an operator or metrics
    token (its series name every node)."""
    app = FastAPI(
        title="kvtrail service",
        version=__version__,
        description="Ingest of audit events, the live judge's findings and the forensics questions.",
    )
    app.state.kvtrail = state  # what the query routes' dependencies read (queries.service_state)

    @app.exception_handler(KvtrailError)
    async def kvtrail_error(_request: Request, exc: KvtrailError) -> JSONResponse:
        if isinstance(exc, ValidationError):
            return JSONResponse({"errors": [exc.to_dict()]}, status_code=422)
        return JSONResponse({"detail": str(exc)}, status_code=exc.http_status)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_request: Request, _exc: ClientDisconnect) -> Response:
        # The client left (or a read deadline closed it) while its body was read: nothing was taken and
        # there is nobody to answer; a quiet 408 instead of a traceback in the service's log.
        return Response(status_code=408)

    @app.get("/healthz", response_model=Health, tags=["service"], summary="Liveness (no token needed)")
    def healthz() -> Health:
        judge = state.judge.stats()
        p50, p99 = judge["lag_p50_s"], judge["lag_p99_s"]
        return Health(
            status="stopping" if state.closed else "ok",
            version=__version__,
            uptime_s=(time.time_ns() - state.started_ns) / 1e9,
            committed_batches=state.committer.committed_batches,
            committed_events=state.committer.committed_events,
            commit_transactions=state.committer.transactions,
            checkpoints=state.store.checkpoints,
            checkpoint_s=round(state.store.checkpoint_s, 6),
            duplicate_batches=state.committer.duplicates,
            judge_polls=int(judge["polls"] or 0),
            judge_failures=int(judge["failures"] or 0),
            judge_lag_p50_s=None if p50 is None else float(p50),
            judge_lag_p99_s=None if p99 is None else float(p99),
            judge_cpu_s=round(float(judge["cpu_s"] or 0.0), 6),
        )

    # It names nodes and counts, never a tenant or a request (docs/alerts.md); with metrics_token only an
    # operator or metrics token may read it, for a service whose port tenants reach.
    metrics = registry_for(
        state.cursor,
        judge_progress=lambda: dict(state.judge.replay.tail.watermark),
        model_violations=state.judge.model.counts,
        export=state.export,
    )

    @app.get(
        "/metrics",
        tags=["service"],
        summary="Prometheus metrics computed from the store (a token only with serve --metrics-token)",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE: {}}}},
    )
    def prometheus_metrics(
        request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
    ) -> Response:
        if metrics_token:
            require_role(authenticate_request(state, request, credentials), "operator", "metrics")
        return Response(exposition(metrics), media_type=CONTENT_TYPE)

    app.include_router(ingest.router(state, max_body_bytes=max_body_bytes))
    app.include_router(queries.router(state))
    return app
