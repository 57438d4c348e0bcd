"""``/v1/audit`` and ``/v1/reports/verify``: the chain checks of ``kvtrail audit verify|head`` and
``kvtrail forensics verify-report`` run by the service on the store it holds (operator tokens only), and
``GET /v1/audit/checkpoint``, the log's signed checkpoint (any token).

``GET /v1/audit/verify`` is ``audit verify --json``; ``POST`` takes what the local form reads from files
(``--expect-heads``' saved heads, ``--public-key``'s PEM) in its body. ``chain_problems`` says how many
of ``problems`` are the chain's own (the rest are saved heads no longer reached), so the CLI prints
them as the local form does. ``POST /v1/reports/verify`` checks a report's ``report.json`` against the
store (:func:`kvtrail.service.reports.check_report`); the report's files are the client's to check.
"""

# No "from __future__ import annotations": FastAPI must see the route-local Annotated aliases as objects.
from collections.abc import Callable
from typing import Annotated, Any

import duckdb
from fastapi import APIRouter, Depends, HTTPException
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from kvtrail.audit.chain import SignatureChecker
from kvtrail.audit.heads import chain_heads, compare_heads, parse_heads
from kvtrail.audit.note import sign_checkpoint
from kvtrail.audit.tlog import current_checkpoint
from kvtrail.audit.verify import verify_store
from kvtrail.service import access, models
from kvtrail.service.auth import principal_dependency, require_role
from kvtrail.service.reports import ReportCheckBody, ReportCheckResult, check_report
from kvtrail.service.tokens import Principal

Run = Callable[[Principal, Callable[[duckdb.DuckDBPyConnection], Any]], Any]


class VerifyBody(BaseModel):
    """What ``audit verify`` reads from files: saved chain heads and an Ed25519 public key (PEM text)."""

    model_config = ConfigDict(extra="forbid")
    expect_heads: list[dict[str, Any]] | None = Field(
        default=None, max_length=100_000, description="The 'heads' list of 'kvtrail audit head --json'."
    )
    public_key_pem: str | None = Field(
        default=None, max_length=10_000, description="Also check every batch's signature with this key."
    )


def verify_document(
    cur: duckdb.DuckDBPyConnection, *, checker: SignatureChecker | None = None, saved: list[dict] | None = None
) -> dict:
    """The document ``kvtrail audit verify --json`` prints (with ``saved`` heads: ``--expect-heads``), plus
    ``access_log`` (the access log's own chain) and ``chain_problems``."""
    report = verify_store(cur, checker=checker)
    head_problems = compare_heads(cur, saved) if saved is not None else []
    log = access.verify_access_log(cur)
    return {
        **report.to_dict(head_problems=head_problems, heads_checked=len(saved or [])),
        "chain_problems": len(report.problems),
        "access_log": {
            "ok": log.ok,
            "entries": log.entries,
            "first_bad": log.first_bad,
            "reason": log.reason,
            "head_digest": log.head_digest,
        },
    }


def router(state: Any, route_class: type, run: Run) -> APIRouter:
    """The audit routes over ``state``; ``run(who, fn)`` calls ``fn`` on a fresh cursor, errors as 4xx."""
    r = APIRouter(route_class=route_class, tags=["audit"])  # mounted inside the query router (prefix /v1)
    Who = Annotated[Principal, Depends(principal_dependency(state))]

    @r.get("/audit/verify", response_model=models.VerifyResult)
    def audit_verify(who: Who) -> models.VerifyResult:
        """Recompute the hash chain (``kvtrail audit verify --json``) and the access log's chain."""
        require_role(who, "operator")
        return run(who, lambda cur: models.VerifyResult(**verify_document(cur)))

    @r.post("/audit/verify", response_model=models.VerifyResult)
    def audit_verify_with(who: Who, body: VerifyBody) -> models.VerifyResult:
        """``kvtrail audit verify --expect-heads FILE --public-key FILE`` with the files' contents in the body."""
        require_role(who, "operator")

        def answer(cur: duckdb.DuckDBPyConnection) -> models.VerifyResult:
            saved = (
                None if body.expect_heads is None else parse_heads(body.expect_heads, "expect_heads", "expect_heads")
            )
            checker = None if body.public_key_pem is None else SignatureChecker(body.public_key_pem.encode())
            return models.VerifyResult(**verify_document(cur, checker=checker, saved=saved))

        return run(who, answer)

    @r.get(
        "/audit/checkpoint",
        response_model=None,
        responses={
            200: {
                "content": {"text/plain": {"schema": {"type": "string"}}},
                "description": "The checkpoint as a C2SP signed note.",
            },
            404: {"model": models.ErrorBody, "description": "The service was started without --signing-key."},
        },
    )
    def audit_checkpoint(who: Who) -> PlainTextResponse:
        """The store's log checkpoint signed with the service's key (``kvtrail audit checkpoint --url``): a
        C2SP signed note. Any token may read it: tenants check their notices' proofs against it."""
        signer = state.checkpoint_signer
        if signer is None:
            raise HTTPException(404, "no checkpoint: the service was started without --signing-key")
        note = run(who, lambda cur: sign_checkpoint(current_checkpoint(cur), signer))
        return PlainTextResponse(note.text(), media_type="text/plain; charset=utf-8")

    @r.get("/audit/heads", response_model=models.Heads)
    def audit_heads(who: Who) -> models.Heads:
        """Each producer's chain head (``kvtrail audit head --json``)."""
        require_role(who, "operator")
        return run(who, lambda cur: models.Heads(heads=[models.HeadRow(**h) for h in chain_heads(cur)]))

    @r.post("/reports/verify", response_model=ReportCheckResult)
    def reports_verify(who: Who, body: ReportCheckBody) -> ReportCheckResult:
        """``kvtrail forensics verify-report --url``: a report's ``report.json`` checked against the store (its
        recorded heads, growth since, the chain, the results re-computed as of those heads)."""
        require_role(who, "operator")
        check = run(who, lambda cur: check_report(cur, body.manifest, body.strict))
        return ReportCheckResult(ok=check.ok, problems=check.problems, notes=check.notes, store=state.db_path.name)

    return r
