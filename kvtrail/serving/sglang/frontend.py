"""Hooks in SGLang's HTTP (tokenizer) process: each response as the client gets it, with its HTTP status.

Every finished request of ``TokenizerManager._stream_one_response`` passes through the async
``_handle_abort_finish_reason(out, state, is_stream)``: it returns for a normal finish (HTTP 200), returns
the output for a streamed abort (HTTP 200, the error travels as an SSE event), raises ``ValueError`` for
a non-streamed abort with 400 (the HTTP server answers 400) and ``fastapi.HTTPException`` with the abort's
status otherwise. The AROUND hook returns a coroutine that awaits SGLang's and records ``response_sent``
with the status that came out of it. Prefill servers' responses go to the router, not to the client:
they are not recorded (as on the scheduler side).

A request the HTTP process refuses itself (a prompt over the context, an invalid parameter) never reaches a
scheduler: ``TokenizerManager._validate_one_request(obj, input_ids)`` raises ``ValueError`` (the server answers
400). The AROUND hook on it records the refusal: ``request_received`` (tenant, the tokenized prompt length),
``request_aborted`` (stage ``http``, SGLang's reason, 400) and, where the client gets it (decode and unified
servers), ``response_sent`` 400 with no output.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from kvtrail.audit.events import RequestRef
from kvtrail.serving.sglang import speculative
from kvtrail.serving.sglang.lifecycle import NO_TENANT, reason_of
from kvtrail.serving.sglang.session import Session, transfer_id

HTTP_OK, HTTP_BAD_REQUEST = 200, 400
NS_PER_S = 1_000_000_000
REFUSAL_STAGE = "http"  # request_aborted.stage of a request the HTTP process refused before any scheduler


def client_status(exc: BaseException | None) -> int | None:
    """The HTTP status SGLang's server answers for what ``_handle_abort_finish_reason`` did; None: not a
    response it decides (another exception propagates to the server's own error handling)."""
    if exc is None:
        return HTTP_OK
    if isinstance(exc, ValueError):
        return HTTP_BAD_REQUEST  # http_server's _create_error_response
    status = getattr(exc, "status_code", None)  # fastapi.HTTPException
    return int(status) if isinstance(status, int) else None


def _ref(state: Any, out: dict) -> RequestRef:
    obj = state.obj
    rid = getattr(obj, "rid", None) or out.get("meta_info", {}).get("id")
    return _obj_ref(obj, rid)


def _obj_ref(obj: Any, rid: Any) -> RequestRef:
    tenant = getattr(obj, "extra_key", None)
    return RequestRef(str(rid), transfer_id(obj), tenant if isinstance(tenant, str) and tenant else None)


def _ttft_ns(state: Any) -> int | None:
    stats = getattr(state, "time_stats", None)
    if stats is None or not getattr(stats, "first_token_time", 0):
        return None
    return max(int(stats.get_first_token_latency() * NS_PER_S), 0)


def record_response(s: Session, out: dict, state: Any, status: int) -> None:
    meta = out.get("meta_info") or {}
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else None
    s.recorder.response_sent(
        _ref(state, out),
        status,
        int(meta.get("prompt_tokens") or 0),
        int(meta.get("completion_tokens") or 0),
        max(int(float(meta.get("e2e_latency") or 0) * NS_PER_S), 0),
        _ttft_ns(state),
        str(kind) if kind else None,
        **speculative.from_meta(meta),
    )


def _call_args(args: tuple, kwargs: dict) -> tuple[Any, dict, Any]:
    """(tokenizer manager, out, state) of a ``_handle_abort_finish_reason(self, out, state, is_stream)`` call."""
    names = ("self", "out", "state")
    got = [args[i] if i < len(args) else kwargs[n] for i, n in enumerate(names)]
    return got[0], got[1], got[2]


def outcome_hook(session_of: Callable[[Any], Session | None]) -> Callable[..., Any]:
    """The AROUND hook on ``_handle_abort_finish_reason``; ``session_of(tokenizer_manager)`` is the HTTP
    process's session (None: not recording, or a prefill server)."""

    def hook(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        coro = original(*args, **kwargs)  # SGLang's call, unchanged, whatever the recording does
        s = session_of(args[0]) if args else None  # a method: the tokenizer manager is always positional
        if s is None:
            return coro
        try:
            _, out, state = _call_args(args, kwargs)
        except (IndexError, KeyError) as err:  # another signature in this build: counted, reported as a gap
            s.resolver.count_failure("_handle_abort_finish_reason", err)
            return coro

        def observed(exc: BaseException | None) -> None:
            try:
                status = client_status(exc)
                if status is not None:
                    record_response(s, out, state, status)
            except Exception as err:  # noqa: BLE001 - never raise into SGLang; counted, reported as a gap
                s.resolver.count_failure("_handle_abort_finish_reason", err)

        async def awaited() -> Any:
            try:
                result = await coro
            except Exception as exc:
                observed(exc)
                raise
            observed(None)
            return result

        return awaited()

    hook.__qualname__ = "kvtrail._handle_abort_finish_reason"
    hook.__kvtrail_body__ = _reads  # type: ignore[attr-defined]  # what Target.expects reads
    return hook


def _reads(_session: Any, tokenizer_manager: Any, out: Any, state: Any, *_: Any, **__: Any) -> None:
    """The arguments :func:`outcome_hook` reads from SGLang's call (its signature is what the release check binds)."""


# ---- requests the HTTP process refuses: TokenizerManager._validate_one_request (AROUND) --------------------


def record_refusal(s: Session, tokenizer_manager: Any, obj: Any, input_ids: Any, exc: BaseException) -> None:
    """A request refused before any scheduler saw it: intake, the refusal with SGLang's reason and, where the
    client gets the answer from this server (not a prefill server's), the 400 response."""
    ref = _obj_ref(obj, getattr(obj, "rid", None))
    if ref.tenant_id is None:
        ref = ref._replace(tenant_id=NO_TENANT)
    prompt = len(input_ids) if input_ids is not None else 0
    params = getattr(obj, "sampling_params", None)
    max_new = params.get("max_new_tokens") if isinstance(params, dict) else None
    s.recorder.request_received(ref, prompt, int(max_new) if isinstance(max_new, int) else None)
    s.recorder.request_aborted(ref, REFUSAL_STAGE, reason_of(exc), HTTP_BAD_REQUEST, prompt)
    if s.role != "prefill":
        s.recorder.response_sent(
            ref, HTTP_BAD_REQUEST, prompt, 0, _since_created_ns(tokenizer_manager, obj), None, "abort"
        )


def _since_created_ns(tokenizer_manager: Any, obj: Any) -> int:
    """End-to-end latency of a refusal: since SGLang created the request's state (its perf_counter clock)."""
    state = getattr(tokenizer_manager, "rid_to_state", {}).get(getattr(obj, "rid", None))
    created = getattr(getattr(state, "time_stats", None), "created_time", None)
    if not isinstance(created, (int, float)) or not created:
        return 0
    return max(int((time.perf_counter() - created) * NS_PER_S), 0)


def refusal_hook(session_of: Callable[[Any], Session | None]) -> Callable[..., Any]:
    """The AROUND hook on ``_validate_one_request``; ``session_of(tokenizer_manager)`` is the session refusals
    are recorded in (None: not recording)."""

    def hook(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)  # SGLang's check, unchanged
        except ValueError as exc:  # refused: the HTTP server answers 400
            s = session_of(args[0]) if args else None
            if s is not None:
                try:
                    names = ("self", "obj", "input_ids")
                    tm, obj, ids = (args[i] if i < len(args) else kwargs[n] for i, n in enumerate(names))
                    record_refusal(s, tm, obj, ids, exc)
                except Exception as err:  # noqa: BLE001 - never raise into SGLang; counted, reported as a gap
                    s.resolver.count_failure("_validate_one_request", err)
            raise

    hook.__qualname__ = "kvtrail._validate_one_request"
    hook.__kvtrail_body__ = _refusal_reads  # type: ignore[attr-defined]  # what Target.expects reads
    return hook


def _refusal_reads(_session: Any, tokenizer_manager: Any, obj: Any, input_ids: Any) -> None:
    """The arguments :func:`refusal_hook` reads from SGLang's call (its signature is what the release check binds)."""
