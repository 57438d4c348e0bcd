"""The router: an OpenAI-style ``POST /v1/completions`` in front of one prefill and one decode worker.

It resolves the tenant from the API key, enforces the advertised context length, assigns the
transfer id (SGLang's bootstrap room), asks prefill to admit the prompt, tells decode the prompt
length so it reserves pages, and returns decode's response. It never sees KV bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from kvtrail.audit.events import RequestRef
from kvtrail.serving.config import StackConfig
from kvtrail.serving.link import WorkerDown, WorkerLink
from kvtrail.serving.messages import Abort, Admitted, DecodeRequest, PrefillRequest, ProtocolError, Rejected, Response


class CompletionRequest(BaseModel):
    """The subset of OpenAI's completion request the reference stack serves (other fields are ignored)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = {400: "invalid_request_error", 401: "authentication_error"}.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param}}, status_code=status)


def _audit_down() -> JSONResponse:
    return _error(503, "the audit store is down: the stack serves nothing it cannot record")


def api_key_id(key: str) -> str:
    """What the audit stores instead of the key: a short hash."""
    return "k:" + hashlib.sha256(key.encode()).hexdigest()[:12]


class RouterCore:
    """Orchestrates one request across the workers and records what the client saw."""

    def __init__(
        self,
        cfg: StackConfig,
        prefill: WorkerLink,
        decode: WorkerLink,
        recorder,
        audit_alive: Callable[[], bool] = lambda: True,
    ):
        self.cfg = cfg
        self.prefill = prefill
        self.decode = decode
        self.rec = recorder
        self._tenants = cfg.tenants
        # Whether the store that records every event is there: without it nothing is served (503), not
        # even a request already worked on, so no client holds an answer the audit cannot have.
        self.audit_alive = audit_alive

    async def complete(self, key: str | None, req: CompletionRequest, abort_after_s: float | None) -> JSONResponse:
        if not self.audit_alive():
            return _audit_down()
        tenant = self._tenants.get(key or "")
        if tenant is None:
            return _error(401, "unknown API key", "authorization")
        if req.stream:
            return _error(400, "field 'stream': streaming is not supported by the reference stack", "stream")
        tokens = req.prompt.encode("utf-8")
        max_new = req.max_tokens or self.cfg.max_new_tokens
        if max_new > self.cfg.max_new_tokens:
            return _error(400, f"field 'max_tokens': at most {self.cfg.max_new_tokens}", "max_tokens")
        ref = RequestRef(uuid.uuid4().hex[:16], secrets.randbits(63), tenant, api_key_id(key or ""))
        started = time.monotonic_ns()
        self.rec.request_received(ref, len(tokens), max_new)
        if len(tokens) + max_new > self.cfg.context_tokens:
            msg = (
                f"field 'prompt': {len(tokens)} prompt tokens + {max_new} max_tokens exceed the context "
                f"length of {self.cfg.context_tokens} tokens"
            )
            return self._finish(ref, started, len(tokens), _error(400, msg, "prompt"), stage="router")
        try:
            return await self._serve(ref, tokens, max_new, started, abort_after_s)
        except (WorkerDown, ProtocolError) as exc:
            return self._finish(ref, started, len(tokens), _error(502, str(exc)), stage="router")
        except asyncio.TimeoutError:
            return self._finish(
                ref, started, len(tokens), _error(504, "timed out waiting for the workers"), stage="router"
            )

    async def _serve(self, ref: RequestRef, tokens: bytes, max_new: int, started: int, abort_after_s):
        room = ref.transfer_id
        assert room is not None, "router: every request it serves has a transfer id"
        timeout = self.cfg.transfer_timeout_s
        admission = self.prefill.expect(room, Admitted, Rejected)
        self.prefill.send(PrefillRequest(room, ref, tokens, abort_after_s is not None))
        msg = await asyncio.wait_for(admission, timeout)
        if isinstance(msg, Rejected):
            return self._finish(ref, started, len(tokens), _error(msg.http_status, msg.error, "prompt"))
        response = self.decode.expect(room, Response)
        self.decode.send(DecodeRequest(room, ref, len(tokens), max_new))
        if abort_after_s is not None:
            # A client disconnect (or a load balancer) aborting the request while KV is in flight.
            await asyncio.sleep(abort_after_s)
            self.decode.send(Abort(room))
            self.prefill.send(Abort(room))
        reply: Response = await asyncio.wait_for(response, timeout)
        status, text, completion_tokens = reply.http_status, reply.text, reply.completion_tokens
        first_token_ns, finish_reason, error = reply.first_token_mono_ns, reply.finish_reason, reply.error
        latency = time.monotonic_ns() - started
        # TTFT as the client sees it: from arrival at the router (prefill and transfer included).
        ttft_ns = first_token_ns - started if first_token_ns is not None else None
        self.rec.response_sent(ref, status, len(tokens), completion_tokens, latency, ttft_ns, finish_reason)
        if status != 200:
            return _error(status, error or "request failed")
        if not self.audit_alive():  # it died while this request was served: its events cannot be recorded
            return _audit_down()
        headers = {"x-kvtrail-ttft-ms": f"{ttft_ns / 1e6:.3f}"} if ttft_ns is not None else None
        return JSONResponse(
            headers=headers,
            content={
                "id": f"cmpl-{ref.request_id}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": "kvtrail-reference",
                "choices": [{"text": text, "index": 0, "finish_reason": finish_reason, "logprobs": None}],
                "usage": {
                    "prompt_tokens": len(tokens),
                    "completion_tokens": completion_tokens,
                    "total_tokens": len(tokens) + completion_tokens,
                },
            },
        )

    def _finish(self, ref: RequestRef, started: int, prompt_tokens: int, resp: JSONResponse, stage: str | None = None):
        if stage is not None:
            self.rec.request_aborted(ref, stage, bytes(resp.body).decode()[:200], resp.status_code, prompt_tokens)
        self.rec.response_sent(
            ref, resp.status_code, prompt_tokens, 0, time.monotonic_ns() - started, finish_reason="abort"
        )
        return resp


def create_app(core: RouterCore) -> FastAPI:
    app = FastAPI(title="kvtrail reference router", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError):
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "(body)"
        return _error(400, f"field '{field}': {err.get('msg', 'invalid')}", field)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        auth = request.headers.get("authorization", "")
        key = auth[7:] if auth.lower().startswith("bearer ") else None
        abort_hdr = request.headers.get("x-kvtrail-abort-after-ms")
        abort_after = None
        if abort_hdr is not None:
            if not core.cfg.faults.late_write:
                return _error(400, "header 'x-kvtrail-abort-after-ms': only with the late_write fault enabled")
            try:
                abort_after = float(abort_hdr) / 1000
            except ValueError:
                return _error(400, "header 'x-kvtrail-abort-after-ms': not a number")
        return await core.complete(key, body, abort_after)

    @app.get("/health")
    async def health():
        audit = core.audit_alive()
        ok = core.prefill.alive and core.decode.alive and audit
        return JSONResponse(
            {"prefill": core.prefill.alive, "decode": core.decode.alive, "audit": "ok" if audit else "degraded"},
            status_code=200 if ok else 503,
        )

    return app
