"""The start-up log parser on logs written from the reference's formats and the older variants."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtrail.preflight import parse_startup_log, parse_text
from kvtrail.preflight.sources import SourceError

DATA = Path(__file__).parent / "data"


def nodes(name: str):
    return parse_startup_log((DATA / name).read_text(), name)


def test_tp8_prefill_of_the_incident_one_pool_not_summed_and_no_look_alikes():
    [n] = nodes("prefill_tp8.log")
    assert (n.rank, n.role, n.pool_tokens, n.context_tokens, n.page_size) == ("TP0", "prefill", 681_280, 1_048_576, 16)
    assert n.version == "0.5.21" and n.checksum_enabled is False and n.canary_enabled is False
    assert n.max_running_requests == 128
    assert not n.notes, "the host pool, K/V sizes without #tokens and max_req_input_len were not taken"


def test_mla_single_gpu_without_rank_and_a_draft_pool_line():
    [n] = nodes("decode_mla.log")
    assert (n.rank, n.role, n.pool_tokens, n.context_tokens, n.page_size) == (None, "decode", 409_600, 131_072, 64)
    assert n.checksum_enabled is True and n.canary_enabled is True


def test_dp_attention_each_dp_rank_its_own_pool_ranks_out_of_order_with_milliseconds():
    dp0, dp1 = nodes("decode_dp2.log")
    assert (dp0.rank, dp0.pool_tokens, dp0.context_tokens) == ("DP0 TP0", 409_600, 131_072)
    assert (dp1.rank, dp1.pool_tokens, dp1.context_tokens) == ("DP1 TP0", 98_304, 131_072)
    assert dp0.role == dp1.role == "decode"  # from the "Decode batch" lines


def test_older_rank_prefixes_and_field_order_and_singular_name():
    [n] = nodes("old_rank.log")
    assert (n.rank, n.pool_tokens, n.context_tokens, n.page_size) == ("TP0", 500_000, 262_144, 1)
    [g] = nodes("gpu_id.log")
    assert (g.rank, g.pool_tokens, g.context_tokens) == ("TP0", 120_000, 131_072)


def test_pasted_prefix_pp_ep_tags_labelled_pool_and_a_wrapped_summary():
    [n] = nodes("pasted_wrapped.log")
    assert (n.rank, n.role, n.pool_tokens, n.context_tokens) == ("TP0", "prefill", 2_097_152, 1_048_576)


@pytest.mark.parametrize(
    "line",
    [
        "[2026-08-14 09:12:03 TP0] K size: 13.00 GB, V size: 13.00 GB",
        "server_args=ServerArgs(max_total_tokens=None, context_length=1048576, max_prefill_tokens=16384)",
        "[2026-08-14 09:12:05 TP0] max_req_input_len=681274, max_context_length=2000000",
        "[2026-08-14 09:12:03 TP0] Host KV Cache is allocated. dtype: torch.bfloat16, #tokens: 4194304, K size: 1 GB",
        "[2026-08-14 09:12:03 TP0] KV Cache VA upper bound. dtype: torch.bfloat16, #tokens: 9999999, K size: 1 GB",
        "[2026-08-14 09:12:03 TP0] KV Cache skipped (no-op pool). Logical #tokens: 9999999, physical K/V size: ~1.0 KB",
        "[2026-08-14 09:12:05 TP0] chunked_prefill_size=8192, max_prefill_tokens=16384, max_running_requests=128",
    ],
)
def test_look_alike_lines_give_no_pool_and_no_context(line):
    assert all(n.pool_tokens is None and n.context_tokens is None for n in parse_startup_log(line, "x.log"))


def test_the_pool_warning_alone_gives_pool_and_context():
    line = (
        "[2026-08-14 09:12:03 TP3] KV pool holds 681280 tokens, fewer than --context-length 1048576. One "
        "full-length request cannot fit"
    )
    [n] = parse_startup_log(line, "w.log")
    assert (n.rank, n.pool_tokens, n.context_tokens) == ("TP3", 681_280, 1_048_576)


def test_disagreeing_pools_keep_the_smaller_and_say_so():
    text = (
        "[x TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 600000, K size: 1 GB, V size: 1 GB\n"
        "[x TP0] max_total_num_tokens=590000, max_running_requests=8, context_len=500000, available_gpu_mem=1 GB"
    )
    [n] = parse_startup_log(text, "d.log")
    assert n.pool_tokens == 590_000 and "smallest" in n.notes[0]


def test_a_truncated_log_yields_no_configuration():
    with pytest.raises(SourceError, match="truncated.log: no KV pool"):
        parse_text((DATA / "truncated.log").read_text(), "truncated.log")
    [n] = parse_text((DATA / "pool_only.log").read_text(), "pool_only.log")
    assert n.pool_tokens == 681_280 and n.context_tokens is None  # never guessed
