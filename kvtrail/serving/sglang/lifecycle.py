"""Hooks on a request's lifecycle in a scheduler: intake, aborts (with the prompt length before any placeholder) and
the outcome where no HTTP process records it."""

from __future__ import annotations

import time
from typing import Any

from kvtrail.serving.sglang import speculative
from kvtrail.serving.sglang.memory import is_aborted
from kvtrail.serving.sglang.session import Session

HTTP_OK, HTTP_BAD_REQUEST = 200, 400
# request_received needs a tenant; SGLang knows one only as a cache namespace (extra_key). Without it the
# request is recorded under the label kvtrail's forensics gives a request whose tenant is not known.
NO_TENANT = "(unknown tenant)"
MAX_REASON_CHARS = 160


def reason_of(msg: Any) -> str:
    """An abort reason as recorded: SGLang's messages carry lengths and rids, never prompt text; cut anyway."""
    return str(msg)[:MAX_REASON_CHARS] or "aborted"


def on_generate_request(s: Session, _scheduler: Any, recv_req: Any, **_: Any) -> None:
    """Scheduler.handle_generate_request (BEFORE): the request reaches this node, with the prompt it sent
    (before any check can replace it by the placeholder) - where prefill's rate samples for F9 start."""
    ids = recv_req.input_ids if recv_req.input_ids is not None else getattr(recv_req, "input_embeds", None) or ()
    params = getattr(recv_req, "sampling_params", None)
    max_new = getattr(params, "max_new_tokens", None)
    s.state(str(recv_req.rid))
    ref = s.ref(recv_req)
    if ref.tenant_id is None:
        ref = ref._replace(tenant_id=NO_TENANT)
    s.recorder.request_received(ref, len(ids), int(max_new) if isinstance(max_new, int) else None)


def on_set_finish_with_abort(
    s: Session, req: Any, error_msg: str, status_code: Any = HTTP_BAD_REQUEST, err_type: str = "BadRequestError"
) -> None:
    """Req.set_finish_with_abort (BEFORE): origin_input_ids still holds the real prompt here."""
    s.state(str(req.rid)).aborted = True
    s.recorder.request_aborted(
        s.ref(req), s.role, reason_of(error_msg), int(status_code or HTTP_BAD_REQUEST), len(req.origin_input_ids)
    )


def on_prepare_abort(s: Session, req: Any, error_message: str, status_code: Any = None) -> None:
    """disaggregation.utils.prepare_abort (BEFORE): an immediate abort (transfer failure, corruption, ...)."""
    s.state(str(req.rid)).aborted = True
    s.recorder.request_aborted(
        s.ref(req), f"{s.role}_transfer", reason_of(error_message), int(status_code or 500), len(req.origin_input_ids)
    )


def on_stream_output(s: Session, streamer: Any, reqs: list, return_logprob: bool = False, skip_req: Any = None) -> None:
    """SchedulerOutputStreamer.stream_output (BEFORE): each finished request's outcome, once.

    Recorded on decode and unified nodes only (in PD mode the client's response comes from decode), and
    only where no HTTP process records the response with its real status (``s.records_responses``).
    """
    now = time.monotonic_ns()
    for req in reqs:
        # With the overlap schedule SGLang streams a finished request twice (one delayed token) and skips the
        # second time by its finished_output flag, which its first stream set: so do we, or it is recorded twice.
        if req is skip_req or not req.finished() or getattr(req, "finished_output", False):
            continue
        rid = str(req.rid)
        if s.role == "prefill" or not s.records_responses:
            s.forget(rid)  # prefill's response goes to the router; or the HTTP process records it
            continue
        st = s.state(rid)
        info = req.finished_reason.to_json() if req.finished_reason is not None else {}
        status = info.get("status_code") or (HTTP_BAD_REQUEST if is_aborted(req) else HTTP_OK)
        s.recorder.response_sent(
            s.ref(req),
            int(status),
            len(req.origin_input_ids),
            len(req.output_ids),
            max(now - st.created_ns, 0),
            None,
            str(info.get("type", "")) or None,
            **speculative.from_req(req),
        )
        s.forget(rid)
