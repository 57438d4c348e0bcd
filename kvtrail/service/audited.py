"""The route class that writes every query into the access log, whatever its outcome.

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
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from kvtrail.service import access


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
                try:
                    response = await handler(request)
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
