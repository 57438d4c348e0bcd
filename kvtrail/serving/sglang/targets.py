"""The hook targets: which SGLang 0.5.23 functions the plugin wraps, and whether each was really patched.

SGLang's ``HookRegistry.apply_hooks`` logs a target that does not resolve (a renamed function, another
version) and skips it without raising, so a silently missing hook would leave a hole in the record.
:func:`unpatched` checks every target after the registry applied them.
"""

from __future__ import annotations

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
# the HTTP (tokenizer) process: the status the client gets
HTTP_OUTCOME = "sglang.srt.managers.tokenizer_manager.TokenizerManager._handle_abort_finish_reason"


@dataclass(frozen=True)
class Target:
    """One hook: a dotted path, SGLang's hook type name (BEFORE/AFTER/AROUND) and the hook function."""

    path: str
    hook_type: str
    hook: Callable[..., Any]


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
