"""A small SGLang world on device cpu: the real allocator, req-to-token pool, radix cache, Req and batches.

What is not SGLang's own here is only what needs a model or a network: the batch's model config, the
scheduler object the node-configuration hook reads, and the Mooncake manager behind a real
``CommonKVSender`` (it hands transfer requests to a list instead of RDMA).
"""

from __future__ import annotations

import array
import types

import numpy as np
import torch
from sglang.srt import runtime_context
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVSender
from sglang.srt.disaggregation.utils import MetadataBuffers
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

PAGE_SIZE = 4
PAGE_BYTES = 16  # one page of the stand-in KV buffer (what the transfer copies and the checksum digests)
MODEL = types.SimpleNamespace(is_encoder_decoder=False, vocab_size=1000, is_multimodal=False, context_len=4096)


_HELD: list = []


def publish(role: str = "null", *, world_rank: int | None = None, dp_rank: int | None = None, **parallel) -> ServerArgs:
    """SGLang's runtime context as its launcher publishes it for one scheduler process: ``parallel`` are
    ServerArgs widths (tp_size, dp_size, enable_dp_attention), ``world_rank`` / ``dp_rank`` the process's
    placement (SpawnRanks); without a placement, TP rank 0 of one rank."""
    ctx = runtime_context.get_parallel()
    if not hasattr(type(ctx), "clear_stamp"):  # 0.5.19: ranks come from live groups; rank 0 of one rank
        args = ServerArgs(
            model_path="dummy",
            device="cpu",
            page_size=PAGE_SIZE,
            disaggregation_mode=role,
            attention_backend="torch_native",  # as on a CPU server: no Triton writers
            **parallel,
        )
        runtime_context.publish(args, role="scheduler")
        held = ctx.override(tp_rank=0, attn_tp_rank=0, attn_cp_rank=0, pp_rank=0)
        held.__enter__()
        _HELD.append(held)  # for the session: a collected override would restore on its way out
        return args
    ctx.clear_stamp()
    args = ServerArgs(model_path="dummy", device="cpu", page_size=PAGE_SIZE, disaggregation_mode=role, **parallel)
    if world_rank is None:
        runtime_context.publish(args, role="scheduler")
        runtime_context.get_parallel().override_permanently(tp_rank=0)
    else:
        runtime_context.publish(
            args, role="scheduler", ranks=runtime_context.SpawnRanks(world_rank=world_rank, dp_rank=dp_rank)
        )
    return args


class Node:
    """One node's pools (need_sort=True as in PD: freed pages are reused lowest first)."""

    def __init__(self, mode: str, num_pages: int = 64, radix: bool = False, checksum: bool = False):
        self.allocator = PagedTokenToKVPoolAllocator(
            size=num_pages * PAGE_SIZE,
            page_size=PAGE_SIZE,
            dtype=torch.bfloat16,
            device="cpu",
            kvcache=None,
            need_sort=True,
        )
        self.pool = ReqToTokenPool(size=16, max_context_len=512, device="cpu", enable_memory_saver=False)
        self.tree = RadixCache(
            CacheInitParams(
                disable=not radix,
                req_to_token_pool=self.pool,
                token_to_kv_pool_allocator=self.allocator,
                page_size=PAGE_SIZE,
            )
        )
        self.metadata = MetadataBuffers(
            size=8,
            hidden_size=16,
            hidden_states_dtype=torch.float32,
            max_sampling_mask_tokens=0,
            kv_checksum_enabled=checksum,
        )
        self.kv = torch.zeros((num_pages + 1, PAGE_BYTES), dtype=torch.uint8)  # page 0 is SGLang's padding page
        # ranks are not the scheduler's: the plugin reads them from the runtime context publish() set
        self.scheduler = types.SimpleNamespace(
            page_size=PAGE_SIZE,
            disaggregation_mode=types.SimpleNamespace(value=mode),
            max_total_num_tokens=num_pages * PAGE_SIZE,
            model_config=MODEL,
            max_running_requests=16,
            server_args=types.SimpleNamespace(disaggregation_enable_kv_checksum=False, kv_canary="none"),
        )

    def batch(self, reqs: list[Req]) -> ScheduleBatch:
        return ScheduleBatch.init_new(
            reqs, self.pool, self.allocator, self.tree, MODEL, False, SpeculativeAlgorithm.NONE
        )


def req(rid: str, tokens: list[int], room: int) -> Req:
    return Req(rid, "", array.array("q", tokens), SamplingParams(max_new_tokens=8), bootstrap_room=room)


class FakeMooncake:
    """The transfer manager behind a real CommonKVSender: records what send() hands it."""

    kv_shard_size = 1
    enable_all_cp_ranks_for_transfer = False
    is_dummy_cp_rank = False

    def __init__(self):
        self.transfer_infos: dict = {}
        self.requests: list = []

    def prepare_send_state_indices(self, state_indices):
        return state_indices

    def add_transfer_request(self, room, kv_indices, index_slice, is_last_chunk, **kw):
        self.requests.append((room, np.asarray(kv_indices).copy(), index_slice, is_last_chunk, kw["num_kv_tokens"]))


def sender(mgr: FakeMooncake, room: int, num_pages: int, dst_pages: np.ndarray) -> CommonKVSender:
    s = object.__new__(CommonKVSender)
    s.kv_mgr, s.bootstrap_room, s.conclude_state = mgr, room, None
    s.curr_idx, s.num_kv_indices, s.aux_index = 0, num_pages, 0
    s._transfer_start_time, s._early_send_wait_event = None, None
    s.trace_ctx = types.SimpleNamespace(copy_for_thread=lambda: None)
    s._record_transfer_indices = lambda kv, st: None
    mgr.transfer_infos[room] = {"decode-0": types.SimpleNamespace(dst_kv_indices=np.asarray(dst_pages))}
    return s


__all__ = ["KVPoll", "Node", "FakeMooncake", "publish", "req", "sender"]
