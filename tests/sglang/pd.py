"""A PD request's path through SGLang's hooked functions on device cpu: intake, prefill extend and send, decode
reservation, commit, checksum verification, steps, finish, and the tokenizer's answer to the client.

What stands in for a GPU or a network: the Adler-32 CUDA kernel (zlib over the same bytes, which SGLang's
kernel equals), the CUDA-ness of the index tensor its computer asserts, the Mooncake copy (a tensor copy
between the two nodes' KV buffers), and the transport of the metadata slot (a row copy).
"""

from __future__ import annotations

import asyncio
import ctypes
import random
import types
import zlib

import numpy as np
import torch
from sglang.srt.disaggregation.decode import SchedulerDisaggregationDecodeMixin
from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer

from tests.sglang.world import PAGE_SIZE, req, sender

SIGNATURE = 0x5151  # the layout signature both roles digest under


class Streamer(SchedulerOutputStreamer):
    """The hooked stream_output, without a detokenizer to send to."""

    is_generation = True

    def _stream_output_generation(self, *args):
        return None


class DecodeScheduler(SchedulerDisaggregationDecodeMixin):
    """The decode mixin's real methods (_verify_kv_checksums, _handle_kv_checksum_mismatch) on a bare scheduler."""


def streamer() -> Streamer:
    return object.__new__(Streamer)


def intake(pnode_or_dnode, rid, room, tokens):
    """Scheduler.handle_generate_request with the tokenized request; the routing behind it is not run."""
    from sglang.srt.managers.scheduler import Scheduler

    sched = object.__new__(Scheduler)
    sched._handle_generate_request = lambda *a, **k: None
    recv = types.SimpleNamespace(
        rid=rid,
        bootstrap_room=room,
        input_ids=tokens,
        input_embeds=None,
        mm_inputs=None,
        sampling_params=types.SimpleNamespace(max_new_tokens=8),
        extra_key=None,
    )
    Scheduler.handle_generate_request(sched, recv)


def extend(node, r):
    """A unified (or prefill) extend of the whole prompt past its radix match, through alloc_for_extend."""
    from sglang.srt.mem_cache import allocation

    r.init_next_round_input(node.tree)
    b = node.batch([r])
    n, p = len(r.origin_input_ids), r.prefix_len
    b.prefix_lens, b.extend_lens, b.extend_num_tokens = [p], [n - p], n - p
    b.seq_lens = b.seq_lens_cpu = torch.tensor([n])
    allocation.alloc_for_extend(b)
    return r


def prefill_request(pnode, rid, room, tokens, mgr, dst_pages, placeholder=False, digest=None):
    """Prefill extends the request, fills its metadata slot and sends its pages; ``digest``: SGLang's checksum
    of what it sends ("bytes": of the pages' bytes, as SGLang computes it; default: a stand-in over the ids)."""
    from sglang.srt.mem_cache import allocation

    intake(pnode, rid, room, tokens)
    r = req(rid, tokens, room)
    if placeholder:  # intake rejected it: SGLang swaps in the 1-token placeholder (origin_input_ids = [0])
        r.set_finish_with_abort("Input length exceeds the maximum allowed length")
    r.init_next_round_input(pnode.tree)
    b = pnode.batch([r])
    n = len(r.origin_input_ids)
    b.prefix_lens, b.extend_lens, b.extend_num_tokens = [0], [n], n
    b.seq_lens = b.seq_lens_cpu = torch.tensor([n])
    r.extend_end = n  # as prepare_for_extend sets it: send_kv_chunk's last chunk digests up to it
    allocation.alloc_for_extend(b)
    r.output_ids.append(7)
    r.metadata_buffer_index, r.disagg_decode_prefix_len = 0, 0
    row = pnode.pool.req_to_token[r.kv.req_pool_idx, :n]
    pages = (row[::PAGE_SIZE] // PAGE_SIZE).numpy().astype(np.int32)
    pnode.kv[torch.from_numpy(pages.astype(np.int64))] = torch.tensor(
        [[(t * 7 + j) % 251 for j in range(pnode.kv.shape[1])] for t in range(len(pages))], dtype=torch.uint8
    )
    pnode.metadata.set_buf(r)
    if digest is None:
        digest = zlib.adler32(bytes(np.asarray(r.origin_input_ids, dtype=np.int64)))
    elif digest == "bytes":  # what send_kv_chunk digests on the last chunk: the pages' real bytes
        digest = digest_of(pnode, pages)
    pnode.metadata.set_kv_checksum(r, digest, SIGNATURE)
    sender(mgr, room, len(pages), dst_pages).send(pages, num_kv_tokens=n)
    return r, pages


def reserve(dnode, rid, room, tokens):
    from sglang.srt.disaggregation import decode as dmod

    intake(dnode, rid, room, tokens)
    r = req(rid, tokens, room)
    r.bootstrap_host, r.bootstrap_port = "127.0.0.1", 8998
    dnode.pool.alloc([r])
    loc = dmod.alloc_for_decode_prealloc(
        dnode.allocator,
        req=r,
        fill_len=len(tokens),
        delta_len=len(tokens),
        prefix_len=0,
        total_prefix_len=0,
        prefix_indices=None,
        uses_swa_tail=False,
        swa_tail_len=0,
        req_to_token_pool=dnode.pool,
    )
    dnode.pool.write((r.kv.req_pool_idx, slice(0, len(loc))), loc.to(torch.int32))
    r.kv.kv_committed_len = len(tokens)
    return r, (loc[::PAGE_SIZE] // PAGE_SIZE).numpy()


def land(pnode, dnode, src_pages, dst_pages, flip_byte=False):
    """What Mooncake's RDMA writes do: prefill's page bytes into decode's pages (pairwise by position)."""
    n = len(src_pages)
    dst = torch.as_tensor(np.asarray(dst_pages[:n], dtype=np.int64))
    dnode.kv[dst] = pnode.kv[torch.as_tensor(np.asarray(src_pages, dtype=np.int64))]
    if flip_byte:  # a bit flipped on the wire or in decode's memory
        dnode.kv[dst[-1], 0] ^= 1


def commit(dnode, pnode, r, computer=None, slot=1):
    from sglang.srt.disaggregation.decode import DecodeRequest, DecodeTransferQueue
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    names = ["output_ids", "cached_tokens", "bootstrap_room"] + (["kv_checksum"] if computer is not None else [])
    for name in names:  # what Mooncake's aux copy carries
        getattr(dnode.metadata, name)[slot] = getattr(pnode.metadata, name)[0]
    q = object.__new__(DecodeTransferQueue)
    q.metadata_buffers, q.spec_algorithm = dnode.metadata, SpeculativeAlgorithm.NONE
    q._skipped_checksum_signatures = set()
    q.scheduler = types.SimpleNamespace(
        kv_checksum_computer=computer,
        disagg_decode_prealloc_queue=types.SimpleNamespace(kv_checksum_signature=SIGNATURE),
        batch_result_processor=types.SimpleNamespace(_maybe_update_reasoning_tokens=lambda *a: None),
    )
    dr = DecodeRequest(req=r, kv_receiver=types.SimpleNamespace(clear=lambda: None), metadata_buffer_index=slot)
    q._commit_transfer_to_req(dr)


class CudaLike(torch.Tensor):
    """A CPU index tensor that passes KvChecksumComputer's ``is_cuda`` assertion."""

    @property
    def is_cuda(self):
        return True


def cpu_adler32(data_ptrs, strides, indices):
    """SGLang's adler32_strided_checksum on CPU: zlib.adler32 of every (buffer, page) item, in order."""
    value = 1
    for base, stride, idx in zip(data_ptrs, strides, indices):
        for page in torch.Tensor.tolist(idx.as_subclass(torch.Tensor)):
            value = zlib.adler32(ctypes.string_at(base + int(page) * stride, stride), value)
    return value


def checksum_computer(node, monkeypatch):
    """SGLang's real KvChecksumComputer over the node's KV buffer, with the kernel's CPU stand-in."""
    from sglang.srt.disaggregation import checksum as ck
    from sglang.srt.disaggregation import decode as dmod

    monkeypatch.setattr(ck, "adler32_strided_checksum", cpu_adler32)
    real = dmod.page_indices_for_request
    monkeypatch.setattr(dmod, "page_indices_for_request", lambda *a, **k: real(*a, **k).as_subclass(CudaLike))
    monkeypatch.delenv("SGLANG_IS_IN_CI", raising=False)
    return ck.KvChecksumComputer(device="cpu", kv_data_ptrs=[node.kv.data_ptr()], kv_item_lens=[node.kv.shape[1]])


def digest_of(node, pages):
    return cpu_adler32([node.kv.data_ptr()], [node.kv.shape[1]], [torch.as_tensor(np.asarray(pages))])


def verify(dnode, reqs, computer):
    """Decode's first batch of these requests: SGLang's own _verify_kv_checksums; returns the batch's reqs."""
    import torch.distributed as dist

    if not dist.is_initialized():  # the mismatch flags' all-reduce runs over a 1-rank group
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    sched = object.__new__(DecodeScheduler)
    sched.kv_checksum_computer = computer
    sched.disagg_decode_prealloc_queue = types.SimpleNamespace(
        kv_manager=types.SimpleNamespace(should_verify_kv_checksum=lambda addr: True),
        kv_checksum_mismatch_injector=random.Random(0),
    )
    sched.req_to_token_pool, sched.token_to_kv_pool_allocator = dnode.pool, dnode.allocator
    sched.attn_tp_cpu_group, sched.tree_cache, sched.output_streamer = None, dnode.tree, streamer()
    sched.metrics_reporter = types.SimpleNamespace(enable_metrics=False)
    b = dnode.batch(list(reqs))
    b.seq_lens = b.seq_lens_cpu = torch.tensor([len(r.origin_input_ids) for r in reqs])
    b.req_pool_indices = b.req_pool_indices_cpu = torch.tensor([r.kv.req_pool_idx for r in reqs])
    b.orig_seq_lens = b.seq_lens
    b.sampling_info = types.SimpleNamespace(filter_batch=lambda *a: None)  # the sampler's state needs a model
    sched._verify_kv_checksums(b)
    return b.reqs


def decode_step(dnode, r):
    from sglang.srt.mem_cache import allocation

    b = dnode.batch([r])
    n = len(r.origin_input_ids)
    b.seq_lens = torch.tensor([n])
    b.seq_lens_cpu = torch.tensor([n])
    b.req_pool_indices = b.req_pool_indices_cpu = torch.tensor([r.kv.req_pool_idx])
    allocation.alloc_for_decode(b, 1)


def finish(dnode, r, out_streamer):
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.common import release_kv_cache

    r.finished_reason = FINISH_LENGTH(len(r.output_ids))
    r.output_ids.append(9)
    out_streamer.stream_output([r], False)
    r.finished_len = len(r.output_ids)
    r.kv.kv_committed_len = r.kv.kv_allocated_len
    release_kv_cache(r, dnode.tree, checkpoint=False)


# ---- the HTTP (tokenizer) process ---------------------------------------------------------------------------


def tokenizer(mode: str = "decode"):
    """A TokenizerManager with only what its real _handle_abort_finish_reason reads."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    tm = object.__new__(TokenizerManager)
    tm.rid_to_state, tm.enable_lora = {}, False
    tm.disaggregation_mode = DisaggregationMode(mode)
    tm.server_args = types.SimpleNamespace(page_size=PAGE_SIZE)
    return tm


def respond(tm, r, *, stream=False, first_token_s=None, latency_s=0.25, extra_meta=None):
    """The tokenizer's end of a finished request as _stream_one_response runs it: the HTTP status the client
    gets (200, or the status of the exception SGLang's server turns into the response)."""
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.tokenizer_manager import ReqState
    from sglang.srt.observability.req_time_stats import APIServerReqTimeStats

    obj = GenerateReqInput(input_ids=[0], rid=str(r.rid), bootstrap_room=r.bootstrap_room, stream=stream)
    stats = APIServerReqTimeStats(disagg_mode=tm.disaggregation_mode)
    stats.created_time = 1.0
    if first_token_s is not None:
        stats.first_token_time = 1.0 + first_token_s
    state = ReqState([], True, asyncio.Event(), obj, stats)
    tm.rid_to_state[obj.rid] = state
    reason = r.finished_reason.to_json()
    out = {
        "meta_info": {
            "id": obj.rid,
            "finish_reason": reason,
            "prompt_tokens": len(r.origin_input_ids),
            "completion_tokens": len(r.output_ids),
            "e2e_latency": latency_s,
            **(extra_meta or {}),  # what else SGLang's _handle_batch_output put there (e.g. speculative counts)
        }
    }

    async def run():
        try:
            await tm._handle_abort_finish_reason(out, state, stream)
        except ValueError:
            return 400
        except Exception as exc:  # fastapi.HTTPException
            return exc.status_code
        return 200

    return asyncio.run(run())
