"""CopyModel: it echoes what its page table covers, so stale K/V of another tenant shows in the output."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtrail.serving.allocator import PageAllocator
from kvtrail.serving.kvpool import KVPool
from kvtrail.serving.model import CopyModel, ModelConfig

CFG = ModelConfig()  # 2 layers x 4 heads x head_dim 32
MODEL = CopyModel(CFG)
CANARY = b"CANARY-A-7f3c"
TEXT_A = b"tenant A: quarterly numbers are confidential. " + CANARY + b" end of A's prompt, more text follows."


def _pool(num_pages=64, page_size=16, **kw):
    return KVPool(CFG.pool_config(num_pages, page_size, **kw))


def test_echo_reads_the_prompt_back_in_order():
    pool = _pool()
    alloc = PageAllocator(64)
    prompt = b"Hello, tenant! The answer is 42."
    pages = alloc.alloc(-(-len(prompt) // 16))
    assert MODEL.prefill(pool, prompt.decode(), pages) == prompt[0]
    assert MODEL.generate(pool, pages, len(prompt), len(prompt)) == prompt
    # Step t copies position t % seq_len: past the end it wraps around.
    assert MODEL.generate(pool, pages, len(prompt), 5, first_step=len(prompt) - 2) == prompt[-2:] + prompt[:3]
    assert [MODEL.decode_step(pool, pages, len(prompt), t) for t in range(4)] == list(prompt[:4])


@pytest.mark.parametrize("page_size", [1, 3, 7, 16, 33])
def test_odd_page_sizes_and_fragmented_page_tables(page_size):
    rng = np.random.default_rng(page_size)
    prompt = bytes(rng.integers(0, 256, 200).tolist())  # every byte value can be a token
    n_pages = -(-len(prompt) // page_size)
    pool = _pool(num_pages=n_pages + 10, page_size=page_size)
    pages = rng.permutation(np.arange(1, n_pages + 11))[:n_pages]  # scattered, unsorted
    MODEL.prefill(pool, prompt, pages)
    assert MODEL.generate(pool, pages, len(prompt), len(prompt)) == prompt


def test_stale_pages_leak_another_tenants_text():
    """The incident: decode attends to reserved pages nobody wrote for this request."""
    ps = 8
    pool = _pool(num_pages=32, page_size=ps)
    alloc = PageAllocator(32, reuse="lowest")
    a_pages = alloc.alloc(-(-len(TEXT_A) // ps))
    MODEL.prefill(pool, TEXT_A, a_pages)
    alloc.free(a_pages)  # A finished; its pages are staged, never zeroed
    alloc.alloc(32 - len(a_pages))  # other traffic drains the free list, so the next request merges
    prompt_b = b"hi, B!"  # fits in one page
    b_pages = alloc.alloc(len(a_pages))  # lowest ids first: exactly A's old pages
    assert sorted(b_pages.tolist()) == sorted(a_pages.tolist())
    MODEL.prefill(pool, prompt_b, b_pages[:1])  # only B's own single page is written
    # Correct length: B reads only its own tokens.
    assert MODEL.generate(pool, b_pages, len(prompt_b), len(prompt_b)) == prompt_b
    # Decode covers every reserved page: B's answer carries A's text.
    covered = len(b_pages) * ps
    out = MODEL.generate(pool, b_pages, covered, covered)
    assert out.startswith(prompt_b) and CANARY in out
    assert out[len(prompt_b) :] == TEXT_A[len(prompt_b) :] + bytes(covered - len(TEXT_A))


def test_never_written_slots_decode_as_nul():
    pool = _pool(num_pages=4, page_size=4)
    MODEL.prefill(pool, b"ab", [1, 2])
    assert MODEL.generate(pool, [1, 2], 8, 8) == b"ab" + bytes(6)


def test_deterministic_weights_and_pool_bytes():
    pools = []
    for seed in (0, 0, 1):
        pool = _pool(num_pages=8, page_size=4)
        CopyModel(ModelConfig(seed=seed)).prefill(pool, b"same prompt", [3, 1, 4])
        pools.append(pool.page_bytes([3, 1, 4]))
    assert pools[0] == pools[1] and pools[0] != pools[2]
    # Every buffer (each layer's K and V) holds different bytes for the same tokens.
    pool = _pool(num_pages=2, page_size=4)
    MODEL.prefill(pool, b"abcd", [1])
    chunks = [b[1].numpy().tobytes() for b in pool.buffers()]
    assert len(set(chunks)) == len(chunks)


def test_chunked_prefill_equals_one_shot_and_write_token_grows():
    text = b"0123456789abcdefghij"
    one, two = _pool(num_pages=4, page_size=8), _pool(num_pages=4, page_size=8)
    pages = [2, 1, 3]
    first = MODEL.prefill(one, text, pages)
    MODEL.prefill(two, text[:11], pages)
    assert MODEL.prefill(two, text[11:], pages, start=11) == first
    assert one.page_bytes(pages) == two.page_bytes(pages)
    MODEL.write_token(one, pages, len(text), ord("!"))
    assert MODEL.generate(one, pages, len(text) + 1, len(text) + 1) == text + b"!"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_pool_still_echoes(dtype):
    pool = _pool(num_pages=20, page_size=16, dtype=dtype)
    prompt = bytes(range(256))
    MODEL.prefill(pool, prompt, list(range(1, 17)))
    assert MODEL.generate(pool, list(range(1, 17)), 256, 256) == prompt


def test_a_long_prompt_round_trips_across_250_pages():
    prompt = (TEXT_A * 100)[:4000]
    pool = _pool(num_pages=260, page_size=16)
    pages = PageAllocator(260).alloc(250)
    MODEL.prefill(pool, prompt, pages)
    assert MODEL.generate(pool, pages, len(prompt), 300, first_step=3700) == prompt[3700:]


def test_bad_input_names_the_field():
    pool = _pool(num_pages=4, page_size=4)
    with pytest.raises(ValueError, match="num_heads"):
        MODEL.prefill(KVPool(ModelConfig(num_heads=2).pool_config(4, 4)), b"x", [1])
    with pytest.raises(ValueError, match="tokens"):
        MODEL.prefill(pool, [65, 256], [1])
    with pytest.raises(ValueError, match="tokens"):
        MODEL.prefill(pool, b"", [1])
    with pytest.raises(ValueError, match="seq_len"):
        MODEL.decode_step(pool, [1], 0, 0)
    with pytest.raises(ValueError, match="seq_len"):
        MODEL.generate(pool, [1], 5, 1)  # one page of 4 cannot cover 5 tokens
    with pytest.raises(ValueError, match="head_dim"):
        ModelConfig(head_dim=15)
    with pytest.raises(ValueError, match="num_layers"):
        ModelConfig(num_layers=0)
    cfg = CFG.pool_config(10, 16, dtype=torch.bfloat16)
    assert (cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.num_pages, cfg.page_size) == (2, 4, 32, 10, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pool_gives_the_same_kv_and_output():
    table = [5, 2, 7, 1, 3, 8, 4, 6]
    cpu, gpu = _pool(num_pages=8, page_size=4), _pool(num_pages=8, page_size=4, device="cuda")
    for pool in (cpu, gpu):
        MODEL.prefill(pool, TEXT_A[:30], table)
    for layer in range(CFG.num_layers):
        for a, b in zip(cpu.gather(layer, table, 30), gpu.gather(layer, table, 30)):
            assert b.is_cuda and torch.allclose(a, b.cpu(), atol=1e-5)  # rope's sin/cos may differ in the last bit
    assert MODEL.generate(gpu, table, 32, 32) == MODEL.generate(cpu, table, 32, 32)
