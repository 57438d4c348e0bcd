"""Checkpoint format 3: the array file (round trip, damage named), prefix-cache holders laid out at once as
inserting them one by one would, a format-2 ``.npz`` still restoring to the same state, and verify reading
every checkpoint whole."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest

from kvtrail.audit.lake import arrayfile
from kvtrail.audit.lake.fs import LakeFS
from kvtrail.audit.lake.manifest import manifest_name, read_manifest
from kvtrail.audit.lake.partition import HOUR_NS
from kvtrail.audit.lake.verify import verify_lake
from kvtrail.audit.store import read_events
from kvtrail.cli import main
from kvtrail.forensics.lake import checkpoint
from kvtrail.forensics.lake.sharesfile import restore_shares
from kvtrail.forensics.replay.engine import ReplayEngine
from kvtrail.forensics.replay.pagestate import PAGE_ARRAYS, PageState
from kvtrail.forensics.replay.shares import INITIAL_SLOTS, PrefixShares
from tests.lake.conftest import BOUNDARY_NS


def test_the_array_file_gives_back_every_array_writable():
    arrays = {
        "i4": np.arange(-5, 5000, dtype=np.int32),
        "pairs": np.arange(40, dtype=np.int64).reshape(20, 2),
        "u8": np.array([2**64 - 1, 0, 7], np.uint64),
        "flags": np.array([True, False, True]),
        "none": np.zeros((0, 3), np.int64),
        "big_endian": np.arange(9, dtype=">i8"),
    }
    info = {"cluster": "c", "ids": ["r1", None]}
    data = arrayfile.pack(info, arrays)
    assert arrayfile.is_array_file(data) and arrayfile.read_info(data) == info
    got_info, got = arrayfile.unpack(data)
    assert got_info == info and list(got) == list(arrays)
    for name, a in arrays.items():
        assert got[name].shape == a.shape and (got[name] == a).all(), name
        assert got[name].dtype == a.dtype.newbyteorder("<"), name
        assert got[name].flags.writeable, name
    got["i4"][0] = 99  # the restored pool changes its arrays in place
    assert arrayfile.check(data) == (info, None)


def test_a_damaged_array_file_is_named():
    data = arrayfile.pack({"x": 1}, {"owner": np.arange(1000, dtype=np.int32)})
    head = data.index(b'"arrays"')
    cases = {
        "bad magic": b"XX" + data[2:],
        "truncated header": data[:12],
        "does not decompress": data[:-20] + bytes(20),
        "outside the file": data[:-1],
        "header is not JSON": data[:head] + b"!" + data[head + 1 :],
    }
    for want, bad in cases.items():
        with pytest.raises(ValueError, match=want):
            arrayfile.unpack(bad)
        info, problem = arrayfile.check(bad)
        assert info is None and want in problem, (want, problem)


def _one_by_one(pool: PageState, hits: list[tuple[int, int, int]]) -> PrefixShares:
    slots = INITIAL_SLOTS
    while slots < len(hits):
        slots *= 2
    pool.shares = PrefixShares(slots)
    for p, r, h in hits:
        pool.share(p, r, h)
    return pool.shares


@pytest.mark.parametrize("num_hits", [0, 5, INITIAL_SLOTS, 3 * INITIAL_SLOTS + 7])
@pytest.mark.parametrize("sparse", [False, True])
def test_hits_laid_out_at_once_are_what_inserting_them_one_by_one_gives(num_hits, sparse):
    rng = np.random.default_rng(num_hits)
    pages = np.sort(rng.integers(1, 3000, num_hits))
    if sparse:
        pages = np.where(pages % 3 == 0, pages + 2**30, pages)
        pages.sort()
    reqs, hashes = rng.integers(0, 500, num_hits), rng.integers(-9, 9**9, num_hits)
    hits = [(int(p), int(r), int(h)) for p, r, h in zip(pages, reqs, hashes)]
    hits = list({(p, r): (p, r, h) for p, r, h in hits}.values())  # a (page, request) holds one hit

    def pool() -> PageState:
        out = PageState.for_pool(2**31)
        if hits:
            out.fit(np.array([p for p, _, _ in hits], np.int64))
        return out

    a, b = pool(), pool()
    ref = _one_by_one(a, hits)
    restore_shares(b, np.array(hits, np.int64).reshape(-1, 3))
    got = b.shares
    for name in ("page", "req", "bhash", "prev", "next", "meta"):
        assert (getattr(ref, name) == getattr(got, name)).all(), name
    assert (a.raw("share_head") == b.raw("share_head")).all() and (a.raw("nshared") == b.raw("nshared")).all()
    assert sorted(got.index[got.index >= 0].tolist()) == list(range(len(hits)))
    assert all(got.find(p, r) == ref.find(p, r) for p, r, _ in hits)
    assert a.shared() == b.shared()
    if hits:  # the laid-out index keeps working: remove and insert as the replay does
        p, r, _ = hits[len(hits) // 2]
        for st in (a, b):
            st.drop(p, r)
            st.share(p, r + 1000, 7)
        assert a.shared() == b.shared() and b.shares.find(p, r) < 0


def _state_at_boundary(fleet_con, node: str) -> tuple[ReplayEngine, tuple[str, str]]:
    engine = ReplayEngine({}, codes=("F1",), fast=False)
    engine.feed(read_events(fleet_con, "node = ? AND wall_ns < ?", [node, BOUNDARY_NS]))
    return engine, ("fleet-sim", node)


def _as_format2(data: bytes) -> bytes:
    """A format-3 checkpoint as format 2 wrote it: the same arrays in an .npz, the info as a member."""
    info, arrays = arrayfile.unpack(data)
    info["format_version"] = 2
    if "released_pages" in arrays:
        arrays["released_pages"] = arrays["released_pages"].astype(np.int64)
    buf = io.BytesIO()
    members = {"info": np.frombuffer(json.dumps(info).encode(), np.uint8), **arrays}
    np.savez_compressed(buf, **members)  # type: ignore[arg-type]  # numpy's stub types the keyword ``allow_pickle``
    return buf.getvalue()


@pytest.mark.parametrize("node", ["prefill-0", "decode-0"])
def test_format3_and_format2_checkpoints_restore_the_same_state(fleet_con, node):
    engine, key = _state_at_boundary(fleet_con, node)
    data = checkpoint.capture(engine.state, key, BOUNDARY_NS)
    assert arrayfile.read_info(data)["format_version"] == checkpoint.FORMAT_VERSION == 3
    old = _as_format2(data)
    assert not arrayfile.is_array_file(old)
    states = []
    for blob in (data, old):
        fresh = ReplayEngine({}, codes=("F1",), fast=False)
        assert checkpoint.read_info(blob) == checkpoint.restore(blob, fresh.state)
        states.append(fresh.state)
    a, b = (s.pools[key] for s in states)
    for spec in PAGE_ARRAYS:
        assert (a.raw(spec.name) == b.raw(spec.name)).all(), spec.name
    assert a.shared() == b.shared() and a.extra == b.extra and a.late == b.late
    assert [(r, [x.tolist() for x in v]) for r, v in a.released.items()] == [
        (r, [x.tolist() for x in v]) for r, v in b.released.items()
    ]
    assert states[0].requests == states[1].requests and states[0].tenants == states[1].tenants
    assert checkpoint.capture(states[1], key, BOUNDARY_NS) == data  # either restores to what was captured


def _rewrite(lake: str, rel: str, data: bytes) -> None:
    """Replace a file and its manifest entry's SHA-256 and size: damage only a format check can see."""
    Path(lake, rel).write_bytes(data)
    m = read_manifest(LakeFS.open(lake))
    path = Path(lake, manifest_name(m.number))
    doc = json.loads(path.read_text())
    doc["files"][rel].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    path.write_text(json.dumps(doc))


def test_verify_reads_every_checkpoint_whole(lake_copy, capsys):
    files = read_manifest(LakeFS.open(lake_copy)).files
    ckpts = sorted(p for p, f in files.items() if f.table == "checkpoint" and f.hour == BOUNDARY_NS // HOUR_NS)
    assert all(p.endswith(".ckpt") and arrayfile.is_array_file(Path(lake_copy, p).read_bytes()) for p in ckpts)
    first, second = ckpts[0], ckpts[1]
    good = Path(lake_copy, first).read_bytes()
    _rewrite(lake_copy, first, good[:-16] + bytes(16))
    _rewrite(lake_copy, second, good)  # another node's checkpoint in its place
    problems = verify_lake(lake_copy).problems
    assert any(p.startswith(f"unreadable checkpoint: {first} (") and "does not decompress" in p for p in problems)
    assert any(p.startswith(f"unreadable checkpoint: {second} (it describes") for p in problems), problems
    assert main(["lake", "verify", lake_copy]) == 1
    assert f"unreadable checkpoint: {first}" in capsys.readouterr().err
