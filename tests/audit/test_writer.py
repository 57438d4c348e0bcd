"""The writer's batch builder: a column several kinds share comes out the same whichever way it is
scattered (a Python list for small batches, per-kind parts and a take for large ones), and a bad value
is reported at its own row either way."""

import numpy as np
import pytest

import kvtrail.audit.writer as writer
from kvtrail.audit.buffer import EventBuffer
from kvtrail.audit.events import KIND_CODES, PAYLOAD_LAYOUT, Producer, RequestRef
from kvtrail.errors import ValidationError

PROD = Producer("c1", "decode-0", "decode", "kvtrail-reference", "0.1", "decode-1")


def _payload(kind: str, **values) -> tuple:
    return tuple(values.get(name) for name in PAYLOAD_LAYOUT[kind])


def _items(bad_at: int | None = None) -> list:
    """A mixed batch: transfers (num_tokens, digest_algo shared by three kinds), reads and frees."""
    buf = EventBuffer(10_000)
    for i in range(30):
        ref = RequestRef(f"r{i}", i, "acme")
        pages = np.arange(i, i + 4, dtype=np.int32)
        tokens = "many" if bad_at is not None and 4 * i + 1 == bad_at else 64
        buf.put(KIND_CODES["transfer_reserved"], ref, pages, None, _payload("transfer_reserved", num_tokens=64))
        buf.put(
            KIND_CODES["transfer_sent"],
            ref,
            pages,
            pages[::-1].copy(),
            _payload("transfer_sent", num_tokens=tokens, is_last_chunk=True, digest=7, digest_algo="adler32"),
        )
        buf.put(
            KIND_CODES["kv_read"],
            ref,
            pages,
            None,
            _payload("kv_read", page_digests=np.arange(4, dtype=np.uint64), digest_algo="kvtrail-page64"),
        )
        buf.put(KIND_CODES["pages_freed"], ref, pages, None, _payload("pages_freed", reason="finish"))
    items, _ = buf.drain([])
    return items


def test_both_scatter_paths_build_the_same_batch(monkeypatch):
    items = _items()
    small = writer.build_batch(PROD, items, 0)
    monkeypatch.setattr(writer, "_SCATTER_MAX_EVENTS", 0)
    large = writer.build_batch(PROD, items, 0)
    assert small.equals(large)
    assert small.column("num_tokens").to_pylist()[:4] == [64, 64, None, None]
    assert small.column("digest_algo").to_pylist()[:4] == [None, "adler32", "kvtrail-page64", None]


@pytest.mark.parametrize("scatter_max", [2048, 0], ids=["list scatter", "take"])
def test_a_bad_value_in_a_shared_column_names_its_row(monkeypatch, scatter_max):
    monkeypatch.setattr(writer, "_SCATTER_MAX_EVENTS", scatter_max)
    with pytest.raises(ValidationError) as err:
        writer.build_batch(PROD, _items(bad_at=41), 0)
    assert err.value.field == "num_tokens" and err.value.event == 41
