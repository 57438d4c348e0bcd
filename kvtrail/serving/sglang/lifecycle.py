"""Hooks on a request's lifecycle: aborts (with the prompt length before any placeholder) and the outcome."""

from __future__ import annotations

import time
from typing import Any

from kvtrail.serving.sglang.memory import is_aborted
from kvtrail.serving.sglang.session import Session

HTTP_OK, HTTP_BAD_REQUEST = 200, 400
MAX_REASON_CHARS = 160


def _reason(msg: Any) -> str:
    # SGLang's abort messages carry lengths and rids, never prompt text; cut anyway.
    return str(msg)[:MAX_REASON_CHARS] or "aborted"


def on_set_finish_with_abort(s: Session, req: Any, error_msg: str, status_code: Any = HTTP_BAD_REQUEST,
                             err_type: str = "BadRequestError") -> None:
    """Req.set_finish_with_abort (BEFORE): origin_input_ids still holds the real prompt here."""
    s.state(str(req.rid)).aborted = True
    s.recorder.request_aborted(s.ref(req), s.role, _reason(error_msg), int(status_code or HTTP_BAD_REQUEST),
                               len(req.origin_input_ids))


def on_prepare_abort(s: Session, req: Any, error_message: str, status_code: Any = None) -> None:
    """disaggregation.utils.prepare_abort (BEFORE): an immediate abort (transfer failure, corruption, ...)."""
    s.state(str(req.rid)).aborted = True
    s.recorder.request_aborted(s.ref(req), f"{s.role}_transfer", _reason(error_message),
                               int(status_code or 500), len(req.origin_input_ids))


def on_stream_output(s: Session, streamer: Any, reqs: list, return_logprob: bool = False,
                     skip_req: Any = None) -> None:
    """SchedulerOutputStreamer.stream_output (BEFORE): each finished request's outcome, once.

    Recorded on decode and unified nodes only: in PD mode the client's response comes from decode.
    """
    if s.role == "prefill":
        return
    now = time.monotonic_ns()
    for req in reqs:
        if req is skip_req or not req.finished():
            continue
        rid = str(req.rid)
        st = s.state(rid)
        info = req.finished_reason.to_json() if req.finished_reason is not None else {}
        status = info.get("status_code") or (HTTP_BAD_REQUEST if is_aborted(req) else HTTP_OK)
        s.recorder.response_sent(s.ref(req), int(status), len(req.origin_input_ids), len(req.output_ids),
                                 max(now - st.created_ns, 0), None, str(info.get("type", "")) or None)
        s.forget(rid)
