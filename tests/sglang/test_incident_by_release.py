"""The incident's input on the release under test, through SGLang's own door: runs on 0.5.19 and on 0.5.23.

Decode reserves every page of an over-long prompt (its pool is large); prefill's intake finds the prompt over its
``max_req_input_len`` (SGLang's ``validate_input_length``) and ``set_finish_with_abort`` swaps in the one-token
placeholder. Then SGLang's real ``PrefillBootstrapQueue.add`` decides. On 0.5.19 it admits the request: prefill
sends one page through Mooncake's sender, decode commits, reads every reserved page (the lowest-first reuse hands it
the previous request's) and answers 200: kvtrail's record is judged F4 + F2 + F1 for exactly that request, the
previous holder as victim. On 0.5.23 the door retires it (``Scheduler.retire_unadmitted_request``): nothing is
sent, decode's reservation is aborted, and nothing is flagged.

Page size 1 and the token allocator, as the real 0.5.19 server runs on CPU (its paged allocator launches Triton
kernels unconditionally). Prefill and decode record as two nodes into one store.
"""

from __future__ import annotations

import array
import dataclasses
import types
from importlib.metadata import version

import numpy as np
import pytest
import torch

from tests.conftest import stored_events
from tests.sglang.conftest import SharedStore

PROMPT = 40  # decode's reservation for the over-long prompt
CONTEXT = 48  # the model's context: prefill's pool is smaller, as in the incident (F8 names it); decode's is not
PREFILL_POOL = 32
PREFILL_MAX_INPUT = min(CONTEXT - 1, PREFILL_POOL - 1) - 5  # SGLang's max_req_input_len: the prompt is over it
RELEASE = version("sglang")
FIXED = tuple(int(x) for x in RELEASE.split(".")[:3]) >= (0, 5, 23)  # the door retires unadmitted rejects


class Node:
    """One role's real pools at page size 1: TokenToKVPoolAllocator (freed pages reused lowest first)."""

    def __init__(self, num_tokens: int):
        from sglang.srt.disaggregation.utils import MetadataBuffers
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache

        self.allocator = TokenToKVPoolAllocator(
            size=num_tokens, dtype=torch.bfloat16, device="cpu", kvcache=None, need_sort=True
        )
        self.pool = ReqToTokenPool(size=8, max_context_len=256, device="cpu", enable_memory_saver=False)
        self.tree = RadixCache(
            CacheInitParams(
                disable=True, req_to_token_pool=self.pool, token_to_kv_pool_allocator=self.allocator, page_size=1
            )
        )
        self.metadata = MetadataBuffers(
            size=4, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=0
        )

    def scheduler(self, mode: str):
        return types.SimpleNamespace(
            page_size=1,
            disaggregation_mode=types.SimpleNamespace(value=mode),
            max_total_num_tokens=self.allocator.size,
            model_config=types.SimpleNamespace(context_len=CONTEXT),
            max_running_requests=8,
            server_args=types.SimpleNamespace(disaggregation_enable_kv_checksum=False, kv_canary="none"),
        )

    def batch(self, reqs):
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        model = types.SimpleNamespace(is_encoder_decoder=False, vocab_size=1000, is_multimodal=False, context_len=4096)
        return ScheduleBatch.init_new(
            reqs, self.pool, self.allocator, self.tree, model, False, SpeculativeAlgorithm.NONE
        )


def make_req(rid, tokens, room):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid, "", array.array("q", tokens), SamplingParams(max_new_tokens=4), bootstrap_room=room)


def intake(rid, room, tokens):
    """Scheduler.handle_generate_request (hooked) with the tokenized request; the routing behind it is not run."""
    from sglang.srt.managers.scheduler import Scheduler

    class Routed(Exception):
        pass

    class Recv(types.SimpleNamespace):
        @property
        def session_params(self):  # 0.5.19 routes in the method itself: stop there, after the hook ran
            raise Routed

    sched = object.__new__(Scheduler)
    sched._handle_generate_request = lambda *a, **k: None
    recv = Recv(
        rid=rid,
        bootstrap_room=room,
        input_ids=tokens,
        input_embeds=None,
        mm_inputs=None,
        sampling_params=types.SimpleNamespace(max_new_tokens=4),
        extra_key=None,
    )
    try:
        Scheduler.handle_generate_request(sched, recv)
    except Routed:
        pass


def streamer():
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer

    class Streamer(SchedulerOutputStreamer):  # the hooked stream_output, without a detokenizer to send to
        is_generation = True

        def _stream_output_generation(self, *args, **kwargs):
            return None

    return object.__new__(Streamer)


def release(node, r, keep):
    from sglang.srt.mem_cache.common import release_kv_cache

    if FIXED:
        release_kv_cache(r, node.tree, checkpoint=keep)
    else:
        release_kv_cache(r, node.tree, is_insert=keep)


def reserve(dnode, rid, room, tokens):
    """Decode's intake and its reservation of every prompt token (alloc_for_decode_prealloc, hooked)."""
    from sglang.srt.disaggregation import decode as dmod

    intake(rid, room, tokens)
    r = make_req(rid, tokens, room)
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
    return r, loc.numpy().copy()


class Mooncake:
    """The transfer manager behind SGLang's real MooncakeKVSender: records what send() hands it."""

    kv_shard_size = 1
    enable_all_cp_ranks_for_transfer = False
    is_dummy_cp_rank = False

    def __init__(self):
        self.transfer_infos: dict = {}
        self.requests: list = []

    def prepare_send_state_indices(self, state_indices):
        return state_indices

    def add_transfer_request(self, room, kv_indices, index_slice, is_last_chunk, **kw):
        self.requests.append((room, np.asarray(kv_indices).copy(), is_last_chunk, kw.get("num_kv_tokens")))


class NoTrace:
    """The sender's trace context: every tracing call is a no-op."""

    def __getattr__(self, name):
        return lambda *a, **k: None


def mooncake_sender(mgr, room, num_pages, dst_pages):
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

    s = object.__new__(MooncakeKVSender)
    s.kv_mgr, s.bootstrap_room, s.conclude_state = mgr, room, None
    s.curr_idx, s.num_kv_indices, s.aux_index = 0, num_pages, 0
    s._transfer_start_time, s._early_send_wait_event = None, None
    s.trace_ctx = NoTrace()
    s._record_transfer_indices = lambda kv, st: None
    mgr.transfer_infos[room] = {"decode-0": types.SimpleNamespace(dst_kv_indices=np.asarray(dst_pages))}
    return s


def door(r):
    """SGLang's real PrefillBootstrapQueue.add: True when it admitted the request (a sender created, queued)."""
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.managers.scheduler import Scheduler

    q = object.__new__(PrefillBootstrapQueue)
    q.queue = []
    q.create_sender = lambda req, num_kv_heads: True
    out = streamer()
    # what Scheduler.retire_unadmitted_request (0.5.23) reads: the request holds no KV, no beam group
    q.scheduler = types.SimpleNamespace(
        beam_coordinator=types.SimpleNamespace(retire_group=lambda req: None),
        _release_aborted_request=lambda req: None,
        output_streamer=out,
    )
    if FIXED:
        q.scheduler.retire_unadmitted_request = lambda req: Scheduler.retire_unadmitted_request(q.scheduler, req)
    PrefillBootstrapQueue.add(q, r, 1)
    return bool(q.queue)


def prefill(pnode, rid, room, tokens, mgr, dst_pages):
    """Prefill's intake (SGLang's validate_input_length against its max_req_input_len), the door, and what an
    admitted request goes through: extend, metadata slot, send. Returns (req, admitted, pages sent)."""
    from sglang.srt.managers.utils import validate_input_length
    from sglang.srt.mem_cache import allocation

    intake(rid, room, tokens)
    r = make_req(rid, tokens, room)
    error = validate_input_length(r, PREFILL_MAX_INPUT, False)
    if error:
        r.set_finish_with_abort(error)  # the placeholder: origin_input_ids = [0], the verdict in to_finish
    if not door(r):
        return r, False, []
    r.init_next_round_input(pnode.tree)
    b = pnode.batch([r])
    n = len(r.origin_input_ids)
    b.prefix_lens, b.extend_lens, b.extend_num_tokens = [0], [n], n
    b.seq_lens = b.seq_lens_cpu = torch.tensor([n])
    allocation.alloc_for_extend(b)
    r.output_ids.append(7)
    r.metadata_buffer_index, r.disagg_decode_prefix_len = 0, 0
    pages = pnode.pool.req_to_token[r.kv.req_pool_idx, :n].numpy().astype(np.int32)
    pnode.metadata.set_buf(r)
    mooncake_sender(mgr, room, len(pages), dst_pages).send(pages, num_kv_tokens=n)
    return r, True, pages


def commit(dnode, pnode, r, slot=1):
    from sglang.srt.disaggregation.decode import DecodeRequest, DecodeTransferQueue
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    for name in ("output_ids", "cached_tokens", "bootstrap_room"):  # what Mooncake's aux copy carries
        getattr(dnode.metadata, name)[slot] = getattr(pnode.metadata, name)[0]
    q = object.__new__(DecodeTransferQueue)
    q.metadata_buffers, q.spec_algorithm = dnode.metadata, SpeculativeAlgorithm.NONE
    q._skipped_checksum_signatures = set()
    q.scheduler = types.SimpleNamespace(
        kv_checksum_computer=None,
        disagg_decode_prealloc_queue=types.SimpleNamespace(kv_checksum_signature=0),
        batch_result_processor=types.SimpleNamespace(_maybe_update_reasoning_tokens=lambda *a: None),
    )
    dr = DecodeRequest(req=r, kv_receiver=types.SimpleNamespace(clear=lambda: None), metadata_buffer_index=slot)
    q._commit_transfer_to_req(dr)


def decode_and_finish(dnode, r, out):
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache import allocation

    b = dnode.batch([r])
    n = len(r.origin_input_ids)
    b.seq_lens = b.seq_lens_cpu = torch.tensor([n])
    b.req_pool_indices = b.req_pool_indices_cpu = torch.tensor([r.kv.req_pool_idx])
    allocation.alloc_for_decode(b, 1)
    r.finished_reason = FINISH_LENGTH(len(r.output_ids))
    r.output_ids.append(9)
    out.stream_output([r], False)  # the scheduler records the response (status from the finish reason)
    r.finished_len = len(r.output_ids)
    r.kv.kv_committed_len = r.kv.kv_allocated_len
    release(dnode, r, keep=False)


def abort_reservation(dnode, r, out):
    """Decode's side of a transfer prefill never started (0.5.23): the request is aborted and its pages released."""
    from sglang.srt.disaggregation.utils import prepare_abort

    prepare_abort(r, "KV transfer failed: prefill rejected the request", status_code=400)
    r.finished_reason = r.to_finish
    out.stream_output([r], False)
    release(dnode, r, keep=False)


@pytest.fixture
def pd(plugin, tmp_path, monkeypatch):
    store = SharedStore(tmp_path / "audit.duckdb")
    pnode, dnode = Node(PREFILL_POOL), Node(CONTEXT)  # decode's pool is small: B reuses A's pages
    base = plugin.config
    sessions = {}
    for role, node, name in (("prefill", pnode, "sg-prefill"), ("decode", dnode, "sg-decode")):
        plugin.config = dataclasses.replace(base, node=name)
        sessions[role] = plugin.start(node.scheduler(role), sink=store)
        assert sessions[role] is not None
    plugin.config = base
    sessions["decode"].records_responses = True  # no HTTP process here: decode's scheduler records the status
    plugin.session = None

    def on(role):
        for s in sessions.values():
            s.resolver.drain()
        plugin.session = sessions[role]

    def close():
        plugin.session = None
        for s in sessions.values():
            s.resolver.drain()
            assert s.recorder.flush(30)
            assert s.resolver.failures == {}, s.resolver.failures
            s.close()
        store.store.close()

    yield plugin, pnode, dnode, on, close, tmp_path / "audit.duckdb"
    plugin.session = None


def test_the_over_long_prompt_is_judged_on_0_5_19_and_refused_before_transfer_on_0_5_23(pd):
    from kvtrail.forensics import ask_findings, open_store

    plugin, pnode, dnode, on, close, db = pd
    assert plugin.missing == [], f"sglang {RELEASE}: hooks not patched: {plugin.missing}"
    out, mgr = streamer(), Mooncake()
    prompt_a, prompt_b = list(range(100, 100 + 20)), list(range(300, 300 + PROMPT))
    assert len(prompt_a) < PREFILL_MAX_INPUT < PROMPT

    on("decode")  # A: a normal request, fully transferred
    ra, a_pages = reserve(dnode, "A", 101, prompt_a)
    on("prefill")
    _, admitted_a, _ = prefill(pnode, "A", 101, prompt_a, mgr, a_pages)
    assert admitted_a
    on("decode")
    commit(dnode, pnode, ra)
    decode_and_finish(dnode, ra, out)

    on("decode")  # B: over prefill's limit, not decode's; decode reserves all of it first (A's pages among them)
    rb, b_pages = reserve(dnode, "B", 202, prompt_b)
    assert set(a_pages) & set(b_pages)
    on("prefill")
    rb_p, admitted, sent = prefill(pnode, "B", 202, prompt_b, mgr, b_pages)
    assert list(rb_p.origin_input_ids) == [0]  # the placeholder, on both releases
    on("decode")
    if FIXED:
        assert not admitted and len(mgr.requests) == 1  # refused at the door: nothing sent for B
        assert type(rb_p.finished_reason).__name__ == "FINISH_ABORT"  # retired: the client gets the 400
        abort_reservation(dnode, rb, out)
    else:
        assert admitted and len(sent) == 1 and mgr.requests[-1][3] == 1  # one page, the placeholder's token
        commit(dnode, pnode, rb)
        decode_and_finish(dnode, rb, out)
    close()

    events = stored_events(db)
    assert not [e.get("detail") for e in events if e["kind"] == "recorder_gap"]
    nodes = {e["producer"]["node"] for e in events}
    assert {"sg-prefill", "sg-decode"} <= nodes
    con = open_store(db)
    try:
        found = ask_findings(con).found
    finally:
        con.close()
    # prefill's pool is smaller than the context (the incident's configuration): F8 names that node, on both releases
    [f8] = [f for f in found if f.code == "F8"]
    assert f8.node == "sg-prefill" and f8.request_id is None, f8
    found = [f for f in found if f.code != "F8"]
    codes = {(f.code, f.request_id) for f in found}
    [aborted] = [
        e
        for e in events
        if e["kind"] == "request_aborted"
        and e["request"]["request_id"] == "B"
        and e["producer"]["node"] == "sg-prefill"
    ]
    assert aborted["prompt_tokens"] == PROMPT and aborted["http_status"] == 400  # the prompt before the placeholder
    if FIXED:
        assert not [e for e in events if e["kind"] == "transfer_sent" and e["request"]["request_id"] == "B"]
        assert not found, codes
    else:
        [sent_b] = [e for e in events if e["kind"] == "transfer_sent" and e["request"]["request_id"] == "B"]
        assert sent_b["num_tokens"] == 1 and sent_b["dst_pages"] == [int(b_pages[0])]
        [resp_b] = [e for e in events if e["kind"] == "response_sent" and e["request"]["request_id"] == "B"]
        assert resp_b["http_status"] == 200
        assert {c for c, rid in codes} == {"F1", "F2", "F4"} and {rid for c, rid in codes} == {"B"}, codes
        # F1: every reserved page past the one sent was read unwritten: A's former pages name A as the victim,
        # the others were never written
        f1s = [f for f in found if f.code == "F1"]
        assert set().union(*(set(f.pages) for f in f1s)) == {int(p) for p in b_pages[1:]}
        reused = {int(p) for p in b_pages[1:]} & {int(p) for p in a_pages}
        assert reused and {p for f in f1s if f.victim_request_ids == ("A",) for p in f.pages} == reused, f1s
