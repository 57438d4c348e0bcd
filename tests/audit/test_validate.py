"""Bad input is rejected with the event, field and reason named; a rejected batch writes nothing."""

import pyarrow as pa
import pytest

from kvtrail.audit.batch import from_dicts, parse_jsonl, read_ipc, write_ipc
from kvtrail.errors import ValidationError
from tests.conftest import alloc, config, event, producer


def _count(store):
    return store.con.execute(
        "SELECT (SELECT count(*) FROM events) + (SELECT count(*) FROM page_runs) "
        "+ (SELECT count(*) FROM batches) + (SELECT count(*) FROM producers)"
    ).fetchone()[0]


@pytest.fixture
def seeded(store):
    store.append(from_dicts([config(0), alloc(1, [1, 2, 3])]))
    return store


BAD = [
    # (description, events builder, field, reason fragment, event index)
    ("wrong type", lambda: [alloc(2, [4, 5]), dict(alloc(3, [6]), pages="six")], "pages", "wrong type", 1),
    ("missing field", lambda: [{k: v for k, v in alloc(2, [4]).items() if k != "purpose"}], "purpose", "missing", 0),
    ("missing envelope", lambda: [{k: v for k, v in alloc(2, [4]).items() if k != "wall_ns"}], "wall_ns", "missing", 0),
    ("negative page", lambda: [alloc(2, [4, -1])], "pages", "out of pool", 0),
    ("padding page", lambda: [alloc(2, [0])], "pages", "padding page", 0),
    ("page beyond pool", lambda: [alloc(2, [4]), alloc(3, [64, 65])], "pages", "pool has 64 pages", 1),
    ("unknown kind", lambda: [event(2, "pages_stolen")], "kind", "unknown kind", 0),
    ("seq backwards vs store", lambda: [alloc(1, [4])], "seq", "going backwards", 0),
    ("seq backwards in batch", lambda: [alloc(5, [4]), alloc(4, [5])], "seq", "going backwards", 1),
    ("seq repeated in batch", lambda: [alloc(5, [4]), alloc(5, [5])], "seq", "repeated", 1),
    (
        "unknown schema version",
        lambda: [dict(alloc(2, [4]), schema_version=2)],
        "schema_version",
        "unknown schema version",
        0,
    ),
    ("unknown field", lambda: [dict(alloc(2, [4]), prompt="secret text")], "prompt", "unknown field", 0),
    ("field not allowed for kind", lambda: [dict(alloc(2, [4]), http_status=200)], "http_status", "not allowed", 0),
    ("bad enum", lambda: [alloc(2, [4], purpose="because")], "purpose", "not one of", 0),
    ("bad role", lambda: [alloc(2, [4], prod=producer(role="cache"))], "role", "not one of", 0),
    ("prefix hit without hashes", lambda: [alloc(2, [4], purpose="prefix_hit")], "block_hashes", "required", 0),
    (
        "hash count mismatch",
        lambda: [alloc(2, [4, 5], purpose="prefix_hit", block_hashes=[1])],
        "block_hashes",
        "one entry per",
        0,
    ),
    (
        "token_end before start",
        lambda: [
            event(2, "kv_written", request={"request_id": "r"}, pages=[4], token_start=9, token_end=3, source="forward")
        ],
        "token_end",
        ">= token_start",
        0,
    ),
    (
        "uint64 overflow",
        lambda: [
            event(2, "transfer_reserved", request={"request_id": "r", "transfer_id": 2**64}, pages=[4], num_tokens=3)
        ],
        "transfer_id",
        "out of range",
        0,
    ),
    (
        "negative count",
        lambda: [
            event(2, "transfer_reserved", request={"request_id": "r", "transfer_id": 1}, pages=[4], num_tokens=-3)
        ],
        "num_tokens",
        ">= 0",
        0,
    ),
    ("no pool known", lambda: [alloc(0, [1], prod=producer(node="other"))], "pages", "pool size unknown", 0),
    # a 336-byte event that declared 2^25 pages for a 1,024-token pool made every replay allocate ~3 GB
    (
        "pool_pages not pool_tokens' pages",
        lambda: [alloc(2, [4]), dict(config(3), pool_pages=2**25)],
        "pool_pages",
        "expected pool_tokens // page_size = 64",
        1,
    ),
    ("pool beyond any GPU", lambda: [config(2, pool_pages=2**31 + 1)], "pool_pages", "implausible pool", 0),
    ("pool of 2^63-1 pages", lambda: [dict(config(2), pool_pages=2**63 - 1)], "pool_pages", "implausible pool", 0),
]


@pytest.mark.parametrize("desc,build,field,reason,index", BAD, ids=[b[0] for b in BAD])
def test_bad_event_rejected_naming_event_field_reason_and_batch_writes_nothing(
    seeded, desc, build, field, reason, index
):
    before = _count(seeded)
    with pytest.raises(ValidationError) as err:
        seeded.append(from_dicts(build()))
    assert err.value.field == field, str(err.value)
    assert reason in err.value.reason, str(err.value)
    assert err.value.event == index
    assert f"field '{field}'" in str(err.value)
    assert _count(seeded) == before
    # the store still accepts the next good batch
    seeded.append(from_dicts([alloc(100, [9])]))


def test_good_events_in_a_rejected_batch_are_not_half_written(seeded):
    batch = [alloc(2, [4, 5]), alloc(3, [6]), alloc(4, [99])]
    with pytest.raises(ValidationError):
        seeded.append(from_dicts(batch))
    assert seeded.con.execute("SELECT count(*) FROM events WHERE seq >= 2").fetchone()[0] == 0
    seeded.append(from_dicts(batch[:2]))
    assert seeded.con.execute("SELECT count(*) FROM events WHERE seq >= 2").fetchone()[0] == 2


def test_malformed_json_line_is_named():
    with pytest.raises(ValidationError, match="line 2 is not valid JSON"):
        parse_jsonl('{"a": 1}\n{not json\n')


def test_arrow_ipc_with_wrong_column_type_is_rejected(store):
    t = from_dicts([config(0), alloc(1, [1, 2])])
    t = t.set_column(t.schema.get_field_index("seq"), "seq", pa.array(["zero", "one"]))
    with pytest.raises(ValidationError) as err:
        store.append(read_ipc(write_ipc(t)))
    assert err.value.field == "seq" and "wrong type" in err.value.reason


def test_garbage_ipc_is_rejected():
    with pytest.raises(ValidationError, match="Arrow IPC"):
        read_ipc(b"not arrow at all")


def test_a_partial_page_of_pool_tokens_is_not_a_page(store):
    # SGLang's allocator has pool_tokens // page_size pages: a pool of 1,000 tokens at 16 holds 62 of them
    store.append(from_dicts([dict(config(0, pool_pages=62), pool_tokens=1000), alloc(1, [62])]))
    with pytest.raises(ValidationError, match="expected pool_tokens // page_size = 62"):
        store.append(from_dicts([dict(config(2, pool_pages=63), pool_tokens=1000)]))
    store.append(from_dicts([config(3, pool_pages=2**31)]))  # the largest plausible pool is accepted


def test_node_config_in_same_batch_sets_the_pool_bound(store):
    store.append(from_dicts([config(0, pool_pages=8), alloc(1, [8])]))
    with pytest.raises(ValidationError, match="pool has 8 pages"):
        store.append(from_dicts([alloc(2, [9])]))
    store.append(from_dicts([config(3, pool_pages=16), alloc(4, [9])]))  # pool grown by a new config


REQUEST = {"request_id": "r", "tenant_id": "t1"}


@pytest.mark.parametrize(
    "events, field, listed",
    [
        # no node_config yet: every event with pages breaks the rule, the config-free request event does not
        (
            lambda: (
                [alloc(0, [1]), event(1, "request_received", request=REQUEST, prompt_tokens=3)]
                + [alloc(s, [s]) for s in (2, 3)]
            ),
            "pages",
            [0, 2, 3],
        ),
        (lambda: [config(0, pool_pages=8), alloc(1, [9]), alloc(2, [3]), alloc(3, [4, 12])], "pages", [1, 3]),
        (lambda: [config(0), alloc(1, [0]), alloc(2, [3]), alloc(3, [-2, 4])], "pages", [1, 3]),
        (lambda: [config(0), alloc(1, [1], purpose="x"), alloc(2, [2]), alloc(3, [3], purpose="y")], "purpose", [1, 3]),
    ],
    ids=["pool unknown", "beyond the pool", "below the pool", "enum"],
)
def test_a_refusal_lists_every_event_that_breaks_its_rule(store, events, field, listed):
    with pytest.raises(ValidationError) as err:
        store.append(from_dicts(events()))
    exc = err.value
    assert exc.field == field and exc.event == listed[0] and exc.events == tuple(listed), (exc, exc.events)
    assert exc.to_dict()["events"] == listed
    assert _count(store) == 0  # refused whole, as before
    # Without the listed events the same batch breaks this rule no more.
    rest = [e for i, e in enumerate(events()) if i not in set(listed)]
    store.append(from_dicts(rest))
    assert store.con.execute("SELECT count(*) FROM events").fetchone()[0] == len(rest)


def test_a_refusal_without_a_list_names_its_event_alone():
    assert ValidationError("pages", "r", event=3).events == (3,)
    assert ValidationError("pages", "r").events == ()
    # a list that does not start at the named event is not believed
    assert ValidationError("pages", "r", event=3, events=(1, 3)).events == (3,)
    assert ValidationError("pages", "r", event=3).at_lines([10, 11, 12, 13]).events == (3,)
    # moved to the batch a part came from: positions through the part's rows, out of range named nowhere
    moved = ValidationError("pages", "r", event=1, kind="kv_read", events=(1, 2)).moved(range(10, 13))
    assert (moved.event, moved.events, moved.kind, moved.field) == (11, (11, 12), "kv_read", "pages")
    assert ValidationError("pages", "r", event=5).moved(range(3)).events == ()
    assert ValidationError("(batch)", "r").moved(range(3)).event is None


def test_a_refusal_for_numbers_already_stored_lists_every_one_of_them(seeded):
    # seeded holds seq 0 and 1: a batch sent again after its reply was lost, with a new event after it
    batch = [config(0), alloc(1, [1, 2, 3]), alloc(2, [4])]
    with pytest.raises(ValidationError) as err:
        seeded.append(from_dicts(batch))
    assert (err.value.field, err.value.events) == ("seq", (0, 1)) and "<= last stored 1" in err.value.reason
    seeded.append(from_dicts(batch[2:]))  # the rest is taken
