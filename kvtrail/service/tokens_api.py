"""``/v1/tokens``: operators add, list and revoke tokens through a running service (the service holds the
store, so ``kvtrail token --url`` is how tokens change while it runs). Every change is in the access log."""

# No "from __future__ import annotations": FastAPI must see the route-local dependency as an object.
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path
from pydantic import BaseModel, ConfigDict, Field

from kvtrail.service import tokens
from kvtrail.service.auth import principal_dependency, require_role
from kvtrail.service.models import ErrorBody
from kvtrail.service.tokens import Principal


class NewToken(BaseModel):
    """A token to make: its role, a note, (producers) the nodes, clusters and node roles it may send for,
    and how long it lasts (seconds; none: until revoked)."""

    model_config = ConfigDict(extra="forbid")
    role: str = Field(max_length=210)
    note: str = Field(default="", max_length=1000)
    nodes: list[str] = Field(default=[], max_length=1000)
    clusters: list[str] = Field(default=[], max_length=1000)
    node_roles: list[str] = Field(default=[], max_length=10)
    expires_in_s: int | None = Field(default=None, ge=1, le=tokens.MAX_LIFETIME_NS // 10**9)


class MadeToken(BaseModel):
    """The new token's id and secret (shown this once)."""

    token_id: str
    token: str


class TokenRow(BaseModel):
    """A stored token (never its secret or hash)."""

    token_id: str
    role: str
    nodes: list[str]
    note: str
    created_ns: int
    revoked_ns: int | None
    clusters: list[str] = []
    node_roles: list[str] = []
    expires_ns: int | None = None


class Revoked(BaseModel):
    """Whether the call revoked the token (false: it was revoked already)."""

    revoked: bool


def router(state: Any, route_class: type) -> APIRouter:
    """The token routes (operator tokens only)."""
    errors: dict[int | str, dict[str, Any]] = {
        c: {"model": ErrorBody, "description": d}
        for c, d in (
            (400, "Bad role, binding or expiry."),
            (401, "Missing, unknown, revoked or expired token."),
            (403, "Not an operator token."),
        )
    }
    # mounted inside the query router, whose prefix is /v1
    r = APIRouter(prefix="/tokens", route_class=route_class, tags=["tokens"], responses=errors)
    who_dep = principal_dependency(state)

    def write(fn):
        with state.write_lock:
            cur = state.cursor()
            try:
                return fn(cur)
            finally:
                cur.close()

    def changed() -> None:
        verified = getattr(state, "verified", None)
        if verified is not None:  # the tokens verified recently are checked again: a revoked one is refused
            verified.clear()

    @r.post("", response_model=MadeToken)
    def add(who: Annotated[Principal, Depends(who_dep)], body: NewToken) -> MadeToken:
        """Make a token; its secret is in this answer only."""
        require_role(who, "operator")
        expires = None if body.expires_in_s is None else time.time_ns() + body.expires_in_s * 10**9
        binding = tokens.Binding(tuple(body.nodes), tuple(body.clusters), tuple(body.node_roles), expires)
        try:
            token_id, secret = write(
                lambda cur: tokens.add_token(cur, body.role, note=body.note, binding=binding, actor=who.token_id)
            )
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        return MadeToken(token_id=token_id, token=secret)

    @r.get("", response_model=list[TokenRow])
    def list_all(who: Annotated[Principal, Depends(who_dep)]) -> list[TokenRow]:
        """Every token, revoked ones included."""
        require_role(who, "operator")
        return [
            TokenRow(
                **{**t.__dict__, "nodes": list(t.nodes), "clusters": list(t.clusters), "node_roles": list(t.node_roles)}
            )
            for t in write(tokens.list_tokens)
        ]

    @r.delete(
        "/{token_id}", response_model=Revoked, responses={404: {"model": ErrorBody, "description": "No such token."}}
    )
    def revoke(who: Annotated[Principal, Depends(who_dep)], token_id: Annotated[str, Path(max_length=100)]) -> Revoked:
        """Revoke a token by id."""
        require_role(who, "operator")
        try:
            return Revoked(revoked=write(lambda cur: tokens.revoke_token(cur, token_id, actor=who.token_id)))
        except ValueError:
            raise HTTPException(404, "no such token") from None
        finally:
            changed()

    return r
