"""FastAPI dependencies for the service's bearer tokens: who is asking (401) and whether they may (403).

The principal of each request is also left on ``request.state.principal`` so that the access log
(:class:`kvtrail.service.queries.LoggedRoute`) can name who asked, whatever the answer was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from kvtrail.service.tokens import Principal, authenticate

# auto_error off: a missing header is our 401 with our message, not FastAPI's 403.
bearer = HTTPBearer(auto_error=False, description="An API token from 'kvtrail token add' (Authorization: Bearer).")
UNAUTHORIZED = {"WWW-Authenticate": "Bearer"}


def principal_dependency(state: Any) -> Callable[..., Principal]:
    """A dependency returning the request's :class:`Principal`; 401 for a missing, unknown or revoked token."""

    def principal(request: Request,
                  credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> Principal:
        if credentials is None or credentials.scheme.lower() != "bearer" or not credentials.credentials:
            raise HTTPException(401, "missing bearer token (Authorization: Bearer <token>)", headers=UNAUTHORIZED)
        cur = state.cursor()
        try:
            who = authenticate(cur, credentials.credentials)
        finally:
            cur.close()
        if who is None:
            raise HTTPException(401, "unknown or revoked token", headers=UNAUTHORIZED)
        request.state.principal = who
        return who

    return principal


def require_role(principal: Principal, *roles: str) -> None:
    """403 unless the principal's role (``producer``, ``operator``, ``tenant``) is one of ``roles``."""
    if principal.role not in roles:
        raise HTTPException(403, f"a {principal.role} token may not do this (needs {' or '.join(roles)})")


def check_ingest(principal: Principal, nodes: Iterable[str]) -> None:
    """403 unless the principal may send events for every node in ``nodes`` (an operator, or a producer
    token bound to no nodes or to all of these)."""
    require_role(principal, "producer", "operator")
    if principal.role == "operator" or not principal.nodes:
        return
    foreign = sorted(set(nodes) - set(principal.nodes))
    if foreign:
        raise HTTPException(403, f"node: this producer token may not send for node {foreign[0]!r}")
