"""Which of a scheduler's SGLang modes the plugin does not audit, and which process records responses.

The hooks follow the paged and token allocators' page lists and the plain decode step. SGLang 0.5.23's
hybrid SWA, HiSparse, Mamba, unified and sharded allocators keep second page spaces (sliding-window or
host pages, state slots) with their own free paths, and speculative decoding allocates through
``alloc_for_spec_decode``; HiCache (``--enable-hierarchical-cache``) loads pages back from host memory
through ``PagedTokenToKVPoolAllocator.alloc``, which no hook sees, and decode's KV offload copies pages
out: a node running one of them is recorded, but its record has holes. The plugin
names them in the node's ``node_config`` event and warns, instead of pretending to audit them.
"""

from __future__ import annotations

from typing import Any

AUDITED_ALLOCATORS = frozenset({"PagedTokenToKVPoolAllocator", "TokenToKVPoolAllocator"})


def unaudited(scheduler: Any) -> list[str]:
    """The modes of this scheduler whose page traffic the hooks do not see (empty: fully audited)."""
    out = []
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    if allocator is not None and type(allocator).__name__ not in AUDITED_ALLOCATORS:
        out.append(f"allocator {type(allocator).__name__}")
    if getattr(scheduler, "enable_hierarchical_cache", False):
        # host-cache load-back allocates through PagedTokenToKVPoolAllocator.alloc, which no hook sees
        out.append("HiCache load-back and write-back allocations")
    if getattr(scheduler, "decode_offload_manager", None) is not None:
        out.append("decode KV offload")
    spec = getattr(scheduler, "spec_algorithm", None)
    if spec is not None and hasattr(spec, "is_none") and not spec.is_none():
        out.append(f"speculative decoding {getattr(spec, 'name', spec)}")
    return out


def responses_in_scheduler(server_args: Any) -> bool:
    """Whether this deployment's client responses pass no Python TokenizerManager that loaded the plugin:
    the gRPC and Rust front ends talk to the schedulers directly, and extra tokenizer worker processes do
    not load plugins. Then the scheduler records each outcome; otherwise the HTTP process does (once)."""
    from sglang.srt.environ import envs

    return bool(
        getattr(server_args, "grpc_mode", False)
        or getattr(server_args, "smg_grpc_mode", False)
        or envs.SGLANG_RUST_SERVER.get()
        or int(getattr(server_args, "tokenizer_worker_num", 1) or 1) > 1
    )
