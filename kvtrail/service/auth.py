"""FastAPI dependencies for the service's bearer tokens: who is asking (401) and whether they may (403).

The principal of each request is also left on ``request.state.principal`` so that the access log
(:class:`kvtrail.service.queries.LoggedRoute`) can name who asked, whatever the answer was.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from kvtrail.audit.events import Producer
from kvtrail.service.tokens import Principal, authenticate

# auto_error off: a missing header is our 401 with our message, not FastAPI's 403.
bearer = HTTPBearer(auto_error=False, description="An API token from 'kvtrail token add' (Authorization: Bearer).")
UNAUTHORIZED = {"WWW-Authenticate": "Bearer"}
VERIFIED_TTL_S = 60.0
VERIFIED_SIZE = 1024


class VerifiedTokens:
    """Tokens a service verified recently, so a producer's every batch does not pay the salted hash again.

    Keyed by the SHA-256 of the presented secret (the secret itself is not kept); an entry lasts
    ``ttl_s`` and every token change the service makes (:meth:`clear`, after an add or a revoke) drops
    them all, so a revoked token is refused from the next request on. Unknown or revoked tokens are never
    kept: each such attempt pays the full check. Thread-safe."""

    def __init__(self, ttl_s: float = VERIFIED_TTL_S, size: int = VERIFIED_SIZE):
        self.ttl_s, self.size = ttl_s, size
        self._lock = threading.Lock()
        self._known: OrderedDict[bytes, tuple[float, Principal]] = OrderedDict()

    @staticmethod
    def _key(secret: str) -> bytes:
        return hashlib.sha256(secret.encode()).digest()

    def get(self, secret: str) -> Principal | None:
        key, now = self._key(secret), time.monotonic()
        with self._lock:
            hit = self._known.get(key)
            if hit is None:
                return None
            if now - hit[0] > self.ttl_s or hit[1].expired():  # an expired token is refused at once
                del self._known[key]
                return None
            return hit[1]

    def put(self, secret: str, who: Principal) -> None:
        key = self._key(secret)
        with self._lock:
            self._known[key] = (time.monotonic(), who)
            self._known.move_to_end(key)
            while len(self._known) > self.size:
                self._known.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._known.clear()


def authenticate_request(state: Any, request: Request, credentials: HTTPAuthorizationCredentials | None) -> Principal:
    """The :class:`Principal` of ``request`` (left on ``request.state.principal``); 401 for a missing, unknown,
    revoked or expired token."""
    if credentials is None or credentials.scheme.lower() != "bearer" or not credentials.credentials:
        raise HTTPException(401, "missing bearer token (Authorization: Bearer <token>)", headers=UNAUTHORIZED)
    verified = getattr(state, "verified", None)
    who = verified.get(credentials.credentials) if verified is not None else None
    if who is None:
        cur = state.cursor()
        try:
            who = authenticate(cur, credentials.credentials)
        finally:
            cur.close()
        if who is None:
            raise HTTPException(401, "unknown, revoked or expired token", headers=UNAUTHORIZED)
        if verified is not None:
            verified.put(credentials.credentials, who)
    request.state.principal = who
    return who


def current_principal(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> Principal:
    """The dependency form of :func:`authenticate_request` for the application's own state (``app.state.kvtrail``)."""
    return authenticate_request(request.app.state.kvtrail, request, credentials)


def principal_dependency(state: Any) -> Callable[..., Principal]:
    """A dependency returning the request's :class:`Principal` over ``state``'s tokens."""

    def principal(
        request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
    ) -> Principal:
        return authenticate_request(state, request, credentials)

    return principal


def require_role(principal: Principal, *roles: str) -> None:
    """403 unless the principal's role (``producer``, ``operator``, ``tenant``) is one of ``roles``."""
    if principal.role not in roles:
        raise HTTPException(403, f"a {principal.role} token may not do this (needs {' or '.join(roles)})")


def check_ingest(principal: Principal, producers: Iterable[Producer]) -> None:
    """403 unless the principal may send events for every producer identity in ``producers``: an operator,
    or a producer token whose bindings (nodes, clusters, node roles; each empty: any) all hold them."""
    require_role(principal, "producer", "operator")
    if principal.role == "operator":
        return
    for p in producers:
        for what, value, allowed in (
            ("node", p.node, principal.nodes),
            ("cluster", p.cluster, principal.clusters),
            ("role", p.role, principal.node_roles),
        ):
            if allowed and value not in allowed:
                raise HTTPException(403, f"{what}: this producer token may not send for {what} {value!r}")
