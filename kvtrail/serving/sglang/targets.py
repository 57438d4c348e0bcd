"""The hook targets: which SGLang functions the plugin wraps on each release, and whether each was really patched.

SGLang's ``HookRegistry.apply_hooks`` logs a target that does not resolve (a renamed function, another
version) and skips it without raising, so a silently missing hook would leave a hole in the record.
:func:`unpatched` checks every target after the registry applied them.
"""

from __future__ import annotations

import inspect
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable

NODE_CONFIG = "sglang.srt.managers.scheduler.Scheduler.init_disaggregation"
INTAKE = "sglang.srt.managers.scheduler.Scheduler.handle_generate_request"
ALLOC_EXTEND = "sglang.srt.mem_cache.allocation.alloc_for_extend"
ALLOC_PREALLOC = "sglang.srt.disaggregation.decode.alloc_for_decode_prealloc"
ALLOC_DECODE = "sglang.srt.mem_cache.allocation.alloc_for_decode"
RELEASE = "sglang.srt.mem_cache.common.release_kv_cache"
PAGE_RETURN = "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator._release_page_ids"
TOKEN_RETURN = "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.free"
SEND = "sglang.srt.disaggregation.common.conn.CommonKVSender.send"
SET_BUF = "sglang.srt.disaggregation.utils.MetadataBuffers.set_buf"
SET_CHECKSUM = "sglang.srt.disaggregation.utils.MetadataBuffers.set_kv_checksum"
COMMIT = "sglang.srt.disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req"
SET_ABORT = "sglang.srt.managers.schedule_batch.Req.set_finish_with_abort"
PREPARE_ABORT = "sglang.srt.disaggregation.utils.prepare_abort"
STREAM = "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer.stream_output"
# a retract releases the request's KV before it marks the request retracted (release_req)
RETRACT = "sglang.srt.managers.schedule_batch.release_req"
# frees inside a free group (batch result processing) are applied at its end, outside the request's release
GROUP_PAGES = "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.free_page_ids"
GROUP_PAGED_TOKENS = "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.free"
GROUP_END = "sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator.free_group_end"
GROUP_PAGED_END = "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.free_group_end"
# decode's side of --disaggregation-enable-kv-checksum
VERIFY = "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin._verify_kv_checksums"
COMPUTE = "sglang.srt.disaggregation.checksum.KvChecksumComputer.compute"
MISMATCH = "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin._handle_kv_checksum_mismatch"
# --kv-canary: every violation SGLang's reporter formats (log and raise modes alike)
CANARY = "sglang.srt.kv_canary.runner.violation_reporter._format_violation"
# the HTTP (tokenizer) process: the status the client gets
HTTP_OUTCOME = "sglang.srt.managers.tokenizer_manager.TokenizerManager._handle_abort_finish_reason"
# ... and the requests it refuses itself (over the context) before any scheduler sees them
HTTP_REFUSAL = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
# a clean shutdown (launch_server's SIGTERM: the tokenizer manager's ShutdownReq): the recorder closes first
SHUTDOWN = "sglang.srt.managers.scheduler.Scheduler.handle_shutdown"
# up to 0.5.22 Mooncake's sender overrides CommonKVSender.send without calling it
MOONCAKE_SEND = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.send"

# The releases the plugin is checked against (tests/sglang/test_release_wheels.py reads each wheel's source).
RELEASES = ("0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23")
# Targets hooked on some releases only: (first, last) release, inclusive, None for open. Every other target
# is hooked on every release. Outside a span the function is absent (free_page_ids before 0.5.20, the KV
# checksum's decode side before 0.5.21) or hooked elsewhere (Mooncake's send after 0.5.22 runs
# CommonKVSender.send); 0.5.21 and 0.5.22 have a KV checksum of another shape (set_kv_checksum(req, value)),
# not hooked: a node running it there is named as not audited for it.
SPANS: dict[str, tuple[str | None, str | None]] = {
    GROUP_PAGES: ("0.5.20", None),
    SET_CHECKSUM: ("0.5.23", None),
    VERIFY: ("0.5.23", None),
    COMPUTE: ("0.5.23", None),
    MISMATCH: ("0.5.23", None),
    MOONCAKE_SEND: (None, "0.5.22"),
}
CHECKSUM_TARGETS = (SET_CHECKSUM, VERIFY, COMPUTE, MISMATCH)


def release(version: str | None) -> tuple[int, ...] | None:
    """A release's number as a tuple ("0.5.19.post1" -> (0, 5, 19)); None for a version that does not parse."""
    if not version:
        return None
    parts: list[int] = []
    for p in version.split("."):
        digits = "".join(c for c in p if c.isdigit()) if p[:1].isdigit() else ""
        if not digits or len(parts) == 3:
            break
        parts.append(int(digits))
    return tuple(parts) if len(parts) == 3 else None


def applies(path: str, version: str | None) -> bool:
    """Whether ``path`` is hooked on SGLang ``version`` (an unknown version gets the newest release's targets)."""
    first, last = SPANS.get(path, (None, None))
    v = release(version) or release(RELEASES[-1])
    return (first is None or v >= release(first)) and (last is None or v <= release(last))  # type: ignore[operator]


@dataclass(frozen=True)
class Target:
    """One hook: a dotted path, SGLang's hook type name (BEFORE/AFTER/AROUND) and the hook function."""

    path: str
    hook_type: str
    hook: Callable[..., Any]

    def expects(self) -> inspect.Signature:
        """The arguments the hook takes from SGLang's call of the target (bound methods: ``self`` first)."""
        body = getattr(self.hook, "__kvtrail_body__", None)
        if body is not None:  # a guard wrapper: the body's signature, less the session (and the result)
            skip = 2 if self.hook_type == "AFTER" else 1
            fn = body
        else:  # the hook itself: less the result (AFTER) or the original (AROUND)
            skip = 0 if self.hook_type == "BEFORE" else 1
            fn = self.hook
        params = list(inspect.signature(fn).parameters.values())[skip:]
        return inspect.Signature(params)


def resolve(path: str) -> Any:
    """What a dotted path names now, as the registry resolves it (the raw class attribute for methods)."""
    obj_path, attr = path.rsplit(".", 1)
    obj = pkgutil.resolve_name(obj_path)
    if isinstance(obj, type) and attr in obj.__dict__:
        return obj.__dict__[attr]
    return getattr(obj, attr)


def _wraps(fn: Any, hook: Callable[..., Any]) -> bool:
    """Whether ``fn`` is a registry wrapper chain that includes ``hook`` (its closure holds it)."""
    seen = 0
    while fn is not None and seen < 32:
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # an empty cell
                continue
        fn = getattr(fn, "__wrapped__", None)
        seen += 1
    return False


def unpatched(targets: list[Target], patched: set[str]) -> list[str]:
    """The targets the registry did not patch with our hook: unresolvable, skipped, or replaced since."""
    missing = []
    for t in targets:
        try:
            current = resolve(t.path)
        except (ImportError, AttributeError, ValueError):
            missing.append(t.path)
            continue
        if t.path not in patched or not _wraps(getattr(current, "__func__", current), t.hook):
            missing.append(t.path)
    return missing
