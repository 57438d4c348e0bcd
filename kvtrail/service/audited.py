"""The route class that writes every query into the access log, whatever its outcome, and bounds how
many queries a token has running and waiting (:mod:`kvtrail.service.limits`; 429 beyond).

Each request to a route of the query router leaves one access-log entry (who: the token id and role
the auth dependency found, or none; what: method, path and query parameters without secrets; the
HTTP status it got), appended under the service's write lock after the handler is done.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from kvtrail.service import access
from kvtrail.service.limits import QueryLimiter, TooManyQueries


def too_many(limiter: QueryLimiter) -> Response:
    """The 429 of a query beyond its token's bounds (``Retry-After`` in seconds)."""
    limits = limiter.limits
    return JSONResponse(
        {
            "detail": f"too many queries of this token: {limits.per_token} running and "
            f"{limits.queue_per_token} waiting at most; retry after {limits.retry_after_s} s"
        },
        status_code=429,
        headers={"Retry-After": str(limits.retry_after_s)},
    )


def record(state: Any, request: Request, status: int) -> None:
    """Append one access-log entry for ``request`` (under ``state.write_lock``)."""
    who = getattr(request.state, "principal", None)
    grouped: dict[str, list[str]] = {}
    for key, value in request.query_params.multi_items():
        grouped.setdefault(key, []).append(value)
    params: dict[str, object] = {k: v[0] if len(v) == 1 else v for k, v in grouped.items()}
    path = request.url.path
    entry = access.AccessEntry(
        who.token_id if who else None, who.role_name if who else None, request.method, path, params, status
    )
    with state.write_lock:
        cur = state.cursor()
        try:
            access.append(cur, entry)
        finally:
            cur.close()


def logged_route(state: Any) -> type[APIRoute]:
    """An ``APIRoute`` subclass bound to ``state`` whose handlers record each request in the access log."""

    class LoggedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def logged(request: Request) -> Response:
                status = 500  # what the client gets when the handler fails unexpectedly
                limiter = state.limiter
                key = limiter.key(request.headers.get("authorization"))
                try:
                    try:
                        await limiter.acquire(key)
                    except TooManyQueries:
                        status = 429
                        return too_many(limiter)
                    try:
                        response = await handler(request)
                    finally:
                        limiter.release(key)
                    status = response.status_code
                    return response
                except HTTPException as exc:
                    status = exc.status_code
                    raise
                except RequestValidationError:
                    status = 422
                    raise
                finally:
                    await run_in_threadpool(record, state, request, status)

            return logged

    return LoggedRoute
