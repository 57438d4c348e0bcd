"""Speculative decoding's acceptance per response, where SGLang keeps it (``--speculative-algorithm``).

The scheduler counts per request (``Req``): ``spec_verify_ct`` verification passes and
``spec_num_correct_drafts`` draft tokens the target model accepted (the bonus token excluded). The HTTP
process puts them into the response's ``meta_info`` (``spec_verify_ct``, ``spec_num_correct_drafts`` and
``spec_num_proposed_drafts`` = passes x (draft tokens - 1)) when the request had a verification pass.
They are recorded as counts on ``response_sent``; forensics derives the rate (accepted / proposed) and
the length (completion tokens / passes). A request without a pass (speculative decoding off, a prefill
node, an abort before decoding) records none: the engine has no figure, and none is made up.
"""

from __future__ import annotations

from typing import Any

_META = (
    ("spec_verify_steps", "spec_verify_ct"),
    ("spec_accepted_drafts", "spec_num_correct_drafts"),
    ("spec_proposed_drafts", "spec_num_proposed_drafts"),
)


def _count(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def from_meta(meta: dict) -> dict[str, int]:
    """The acceptance counts of a response's ``meta_info`` (HTTP process), as ``response_sent`` arguments."""
    if not _count(meta.get("spec_verify_ct")):
        return {}
    return {name: n for name, key in _META if (n := _count(meta.get(key))) is not None}


def from_req(req: Any) -> dict[str, int]:
    """The acceptance counts SGLang's ``Req`` holds (scheduler); the proposed drafts are not on it."""
    steps = _count(getattr(req, "spec_verify_ct", None))
    if not steps:
        return {}
    out = {"spec_verify_steps": steps}
    accepted = _count(getattr(req, "spec_num_correct_drafts", None))
    if accepted is not None:
        out["spec_accepted_drafts"] = accepted
    return out
