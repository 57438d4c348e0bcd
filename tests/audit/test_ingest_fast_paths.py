"""The ingest path's shortcuts for the common batch (one producer, lists built by pyarrow) must give what
the general path gives on every other batch."""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from kvtrail.audit import pagelist
from kvtrail.audit.arrowutil import flat_list, pack_lists
from kvtrail.audit.batch import from_dicts
from kvtrail.audit.store import read_events
from kvtrail.audit.validate import ProducerState, validate_batch
from kvtrail.errors import ValidationError
from tests.conftest import alloc, config, producer


def test_flat_list_leaves_out_values_under_a_null_list():
    # Legal Arrow that pyarrow never builds: the null second list still spans values 2..4.
    validity = pa.py_buffer(np.packbits(np.array([1, 0, 1], bool), bitorder="little").tobytes())
    offsets = pa.py_buffer(np.array([0, 2, 5, 6], np.int32).tobytes())
    col = pa.ListArray.from_buffers(
        pa.list_(pa.int32()), 3, [validity, offsets], children=[pa.array(np.arange(10, 16, dtype=np.int32))]
    )
    flat, offs = flat_list(col)
    assert flat.tolist() == pc.list_flatten(col).to_numpy().tolist() == [10, 11, 15]
    assert offs.tolist() == [0, 2, 2, 3]


def test_flat_list_of_a_sliced_column_with_null_lists():
    col = pa.array([[1, 2], None, [3], [], [4, 5, 6]], pa.list_(pa.int32())).slice(1, 4)
    flat, offs = flat_list(col, np.int64)
    assert flat.dtype == np.int64 and flat.tolist() == [3, 4, 5, 6]
    assert offs.tolist() == [0, 0, 1, 1, 4]


def test_a_batch_whose_last_row_has_another_instance_is_two_producers():
    other = producer(instance="i2")
    rows = [config(0), alloc(1, [1, 2]), config(0, prod=other), alloc(1, [3], prod=other)]
    vb = validate_batch(from_dicts(rows), {})
    assert len(vb.producer_ids) == 2 and vb.producer_index.tolist() == [0, 0, 1, 1]


def test_an_empty_producer_field_is_refused_naming_the_event():
    rows = [config(0), alloc(1, [1]), alloc(2, [2], prod=producer(node=""))]
    with pytest.raises(ValidationError, match="node") as exc:
        validate_batch(from_dicts(rows), {})
    assert exc.value.event == 2


def test_the_pool_bound_comes_from_the_store_when_the_batch_has_no_node_config():
    with pytest.raises(ValidationError, match="pool size unknown"):
        validate_batch(from_dicts([alloc(5, [63, 64])]), {})
    pid = validate_batch(from_dicts([config(0)]), {}).producer_ids[0]
    assert validate_batch(from_dicts([alloc(5, [63, 64])]), {pid: ProducerState(4, 64)}).num_page_events == 2
    with pytest.raises(ValidationError, match="out of pool"):
        validate_batch(from_dicts([alloc(5, [64, 65])]), {pid: ProducerState(4, 64)})


def test_pages_and_dst_pages_of_one_event_keep_their_order(store):
    sent = {
        "schema_version": 1,
        "producer": producer(),
        "seq": 2,
        "wall_ns": 10,
        "mono_ns": 10,
        "kind": "transfer_sent",
        "request": {"request_id": "r1", "transfer_id": 7},
        "pages": [5, 6, 9, 1],
        "dst_pages": [30, 31, 2, 3],
        "num_tokens": 64,
        "is_last_chunk": True,
    }
    store.append(from_dicts([config(0), alloc(1, [5, 6, 9, 1]), sent]))
    back = read_events(store.con).to_pylist()
    assert back[2]["pages"] == [5, 6, 9, 1] and back[2]["dst_pages"] == [30, 31, 2, 3]


def _runs_by_hand(lists):
    out = []
    for r, pages in enumerate(lists):
        for pos, page in enumerate(pages):
            if pos and page == pages[pos - 1] + 1:
                out[-1][3] += 1
            else:
                out.append([r, pos, page, 1])
    return out


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1 << 18])
def test_run_breaks_are_found_across_chunk_edges(monkeypatch, chunk):
    monkeypatch.setattr(pagelist, "_CHUNK", chunk)
    rng = np.random.default_rng(chunk)
    lists = []
    for _ in range(60):
        start = int(rng.integers(1, 50))
        pages = list(range(start, start + int(rng.integers(0, 9))))
        if pages and rng.random() < 0.5:
            pages[int(rng.integers(len(pages)))] += 3
        lists.append(pages)
    lists.append([2**31 - 1, 1])  # the id after the largest wraps: still a break
    offsets = np.zeros(len(lists) + 1, np.int64)
    np.cumsum([len(x) for x in lists], out=offsets[1:])
    flat = np.array([p for x in lists for p in x], np.int32)
    row, pos, start, length = pagelist.encode_runs(flat, offsets)
    assert np.column_stack([row, pos, start, length]).tolist() == _runs_by_hand(lists)


def test_pack_lists_mixes_none_empty_tuples_and_arrays_exactly():
    big = np.array([2**64 - 1, 2**63 + 1], np.uint64)  # beyond float64: an empty float array must not upcast
    flat, offsets, absent = pack_lists([None, np.array([]), big, (), None, np.array([5], np.uint64)], np.uint64)
    assert flat.tolist() == [2**64 - 1, 2**63 + 1, 5] and flat.dtype == np.uint64
    assert offsets.tolist() == [0, 0, 0, 2, 2, 2, 3]
    assert absent is not None and absent.tolist() == [True, False, False, False, True, False]
    flat, offsets, absent = pack_lists([(1, 2), [3]], np.int32)
    assert flat.tolist() == [1, 2, 3] and offsets.tolist() == [0, 2, 3] and absent is None
