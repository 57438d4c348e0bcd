"""Small audit histories for the alert tests: the incident's misconfiguration and a foreign read."""

from __future__ import annotations

from tests.conftest import T0, event, producer

PREFILL = producer("prefill-0", "prefill", instance="p1")
DECODE = producer("decode-0", "decode", instance="d1")
POOL_TOKENS, CONTEXT_TOKENS = 681_280, 1_048_576


def node_configs(seq0: int = 0, *, pool_tokens: int = POOL_TOKENS, wall_ns: int = T0) -> list[dict]:
    """Prefill with a pool smaller than its context (the incident), decode with a large enough one."""
    return [
        event(
            seq0,
            "node_config",
            PREFILL,
            wall_ns=wall_ns,
            pool_tokens=pool_tokens,
            pool_pages=pool_tokens // 16,
            page_size=16,
            context_tokens=CONTEXT_TOKENS,
            checksum_enabled=False,
            deferred_release=True,
            release_timeout_ns=30 * 10**9,
            transfer_batch_max_pages=256,
        ),
        event(
            seq0,
            "node_config",
            DECODE,
            wall_ns=wall_ns,
            pool_tokens=2_097_152,
            pool_pages=131_072,
            page_size=16,
            context_tokens=CONTEXT_TOKENS,
            checksum_enabled=True,
            canary_enabled=True,
            deferred_release=True,
        ),
    ]


def foreign_read(seq0: int = 1, wall_ns: int = T0 + 10_000) -> list[dict]:
    """On decode: r1 writes pages 1-2 and frees them; r2 reserves 1-3, one page lands, it reads all three."""

    def ev(i, kind, rid, **kw):
        return event(
            seq0 + i,
            kind,
            DECODE,
            wall_ns=wall_ns + i * 1000,
            request={"request_id": rid, "tenant_id": "t-" + rid},
            **kw,
        )

    return [
        ev(0, "pages_allocated", "r1", pages=[1, 2], purpose="prefill_extend"),
        ev(1, "kv_written", "r1", pages=[1, 2], token_start=0, token_end=32, source="forward"),
        ev(2, "pages_freed", "r1", pages=[1, 2], free_reason="finish"),
        ev(3, "pages_allocated", "r2", pages=[1, 2, 3], purpose="decode_reservation"),
        ev(4, "kv_written", "r2", pages=[1], token_start=0, token_end=16, source="transfer_in"),
        ev(5, "kv_read", "r2", pages=[1, 2, 3]),
    ]


def transfer_abort(seq: int, reason: str, http_status: int, rid: str = "r9") -> dict:
    return event(
        seq,
        "request_aborted",
        DECODE,
        wall_ns=T0 + 50_000 + seq,
        request={"request_id": rid, "tenant_id": "t-" + rid},
        stage="transfer",
        abort_reason=reason,
        http_status=http_status,
    )
