"""``GET /v1/model/violations``: ``kvtrail model validate --url``, the model's monitors run by the service
on the store it holds (operator tokens only); the document is ``model validate --json``'s."""

# No "from __future__ import annotations": FastAPI must see the route-local Annotated aliases as objects.
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query

from kvtrail.errors import KvtrailError
from kvtrail.forensics import Window
from kvtrail.model.validate import validate_store
from kvtrail.service.auth import principal_dependency, require_role
from kvtrail.service.tokens import Principal
from kvtrail.timeutil import parse_utc


def _time(text: str | None, field: str) -> int | None:
    if not text:
        return None
    try:
        return parse_utc(text, field=field)
    except KvtrailError as exc:
        raise HTTPException(400, str(exc)) from None


def router(state: Any, route_class: type, run: Callable) -> APIRouter:
    """The model route over ``state``; ``run(who, fn)`` calls ``fn`` on a fresh cursor, errors as 4xx."""
    r = APIRouter(route_class=route_class, tags=["model"])  # mounted inside the query router (prefix /v1)
    Who = Annotated[Principal, Depends(principal_dependency(state))]

    @r.get("/model/violations")
    def model_violations(
        who: Who,
        from_: Annotated[str | None, Query(alias="from", description="UTC start of the window (ISO 8601).")] = None,
        to: Annotated[str | None, Query(description="UTC end of the window (ISO 8601).")] = None,
    ) -> dict:
        """The model's properties as monitors over the stored history: violations and coverage."""
        require_role(who, "operator")
        w = Window(_time(from_, "from"), _time(to, "to"))
        return run(who, lambda cur: validate_store(cur, w))

    return r
