"""Hooks in SGLang's HTTP (tokenizer) process: each response as the client gets it, with its HTTP status.

Every finished request of ``TokenizerManager._stream_one_response`` passes through the async
``_handle_abort_finish_reason(out, state, is_stream)``: it returns for a normal finish (HTTP 200), returns
the output for a streamed abort (HTTP 200, the error travels as an SSE event), raises ``ValueError`` for
a non-streamed abort with 400 (the HTTP server answers 400) and ``fastapi.HTTPException`` with the abort's
status otherwise. The AROUND hook returns a coroutine that awaits SGLang's and records ``response_sent``
with the status that came out of it. Prefill servers' responses go to the router, not to the client:
they are not recorded (as on the scheduler side).
"""

from __future__ import annotations

from typing import Any, Callable

from kvtrail.audit.events import RequestRef
from kvtrail.serving.sglang import speculative
from kvtrail.serving.sglang.session import Session

HTTP_OK, HTTP_BAD_REQUEST = 200, 400
NS_PER_S = 1_000_000_000


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
    room = getattr(obj, "bootstrap_room", None)
    tenant = getattr(obj, "extra_key", None)
    rid = getattr(obj, "rid", None) or out.get("meta_info", {}).get("id")
    return RequestRef(
        str(rid),
        int(room) if isinstance(room, int) and room >= 0 else None,
        tenant if isinstance(tenant, str) and tenant else None,
    )


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
