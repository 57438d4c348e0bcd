"""SGLang's KV canary (``--kv-canary log|raise``) as evidence: each violation it reports, recorded on its page.

The canary keeps a side record per token slot (token, position, chain hash of the previous slot) and
verifies it around each forward; a failure lands in a device ring that ``ViolationReporter`` pumps a step
or more later, formatting each row with ``violation_reporter._format_violation(row=...)`` (in ``log``
mode into a WARNING, in ``raise`` mode into the RuntimeError that stops the scheduler). The AFTER hook
on that function sees every violation in both modes, as host ints (the reporter already copied the
ring to the host), and its first line is the one SGLang freezes for its own tests
(``kv_canary violation: launch_tag=<TAG> fail_reason=<r1+r2|none> slot_idx=<n> position=<n> ...``).

The engine names token slots, not requests: the event is ``kv_canary_violation`` on the page that holds
the slot (slot // page size); forensics attributes it to the request holding that page then. Slots of
the sliding-window pool (tags ending ``_SWA``) index another pool than the one the audit's page ids
name, and hybrid SWA is a mode the plugin declares not audited: those are left out, as is a slot in the
padding page.
"""

from __future__ import annotations

import re
from typing import Any

from kvtrail.serving.sglang.session import Session

# The frozen first line (SGLang's own tests parse it with the same keys).
LINE = re.compile(r"kv_canary violation: launch_tag=(\S+) fail_reason=(\S+) slot_idx=(-?\d+) position=(-?\d+)")
SWA_SUFFIX = "_SWA"
MAX_FIELD_CHARS = 64


def parse(message: str) -> tuple[str, str, int, int] | None:
    """(launch tag, fail reasons, slot, position) of a violation's message; None if it is not one."""
    m = LINE.search(message)
    if m is None:
        return None
    return m.group(1)[:MAX_FIELD_CHARS], m.group(2)[:MAX_FIELD_CHARS], int(m.group(3)), int(m.group(4))


def on_violation(s: Session, result: Any, *_: Any, **__: Any) -> None:
    """violation_reporter._format_violation (AFTER): one violation, recorded on the page of its slot."""
    parsed = parse(result) if isinstance(result, str) else None
    if parsed is None:
        raise ValueError("kv canary message without its structured first line")
    tag, reason, slot, position = parsed
    page = slot // s.page_size
    if tag.endswith(SWA_SUFFIX) or page < 1:
        return
    # through the resolver's queue, behind the allocations hooks handed it before: the record keeps the order
    # in which SGLang did them (a violation after the allocation of its page), which holder attribution reads
    s.later(
        "_format_violation",
        s.recorder.kv_canary_violation,
        (page,),
        slot,
        tag,
        reason,
        position if position >= 0 else None,
    )
