"""Page-state checkpoints: one node's pool as the replay engine holds it at an hour boundary.

A checkpoint is what a replay of the node's history up to the boundary knows about its pool: every
per-page array of :class:`~kvtrail.forensics.replay.pagestate.PageState` (holder, last writer with its
time, event, digest and block hash, generations), the rare states beside them (double holders,
prefix-cache holders with their block hashes, bounded release history, late writes) and the request ids
and tenants those name. Loading it into a fresh :class:`~kvtrail.forensics.replay.state.ReplayState`
lets a task judge the hour's partition without replaying the history before it.

Request indices are compacted to the requests the pool still names (in their original order, so the
relative order of indices is kept) and the prefix-cache holders are laid out again page by page in hit
order (slot k holds the k-th hit, each page's chain newest first, as inserting them one by one would).
From format 3 the file is :mod:`kvtrail.audit.lake.arrayfile`'s (each array zstd-compressed on its own,
restored without a copy; released page lists as 32-bit page ids where they fit); formats 1 and 2 are an
``.npz`` (no pickles) with the ids in a JSON member, and still restore.
"""

from __future__ import annotations

import io
import json
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from kvtrail.audit.lake import arrayfile
from kvtrail.forensics.lake.sharesfile import restore_shares
from kvtrail.forensics.replay.event import NodeKey
from kvtrail.forensics.replay.pagestate import PAGE_ARRAYS, PageState
from kvtrail.forensics.replay.state import ReplayState

# 2: each request's tenant (requests are (id, tenant), not the id alone); 3: the array file, not an .npz
FORMAT_VERSION = 3
_READS = (1, 2, FORMAT_VERSION)  # 1 keyed a request by its id: its tenant is the first one named for the id
_REQUEST_ARRAYS = ("owner", "alloc_req", "writer")  # page arrays that hold request indices


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint says about itself (its JSON member)."""

    cluster: str
    node: str
    boundary_ns: int  # the state holds every event of the node before this time
    has_pool: bool
    instance: str | None


def _referenced(pool: PageState) -> np.ndarray:
    refs = [getattr(pool, name) for name in _REQUEST_ARRAYS]
    refs.append(np.fromiter((r for rs in pool.extra.values() for r in rs), np.int64))
    refs.append(np.fromiter((r for hits in pool.shared().values() for r in hits), np.int64))
    refs.append(np.fromiter(pool.released.keys(), np.int64))
    refs.append(np.fromiter((v[1] for v in pool.late.values()), np.int64))
    flat = np.concatenate([np.asarray(a, np.int64).ravel() for a in refs])
    return np.unique(flat[flat >= 0])


def capture(state: ReplayState, key: NodeKey, boundary_ns: int) -> bytes:
    """The checkpoint of node ``key``'s pool in ``state`` (bytes of an array file)."""
    pool = state.pools.get(key)
    info = {
        "format_version": FORMAT_VERSION,
        "cluster": key[0],
        "node": key[1],
        "boundary_ns": int(boundary_ns),
        "has_pool": pool is not None,
        "instance": state.pool_instance.get(key),
    }
    arrays: dict[str, np.ndarray] = {}
    if pool is not None:
        used = _referenced(pool)
        remap = np.full(len(state.requests) + 1, -1, np.int64)  # index -1 stays -1 (last entry)
        remap[used] = np.arange(len(used))
        for spec in PAGE_ARRAYS:  # entries, as the pool lays them out (its sparse pages after the dense part)
            arr = pool.raw(spec.name)
            arrays[spec.name] = remap[arr].astype(arr.dtype) if spec.name in _REQUEST_ARRAYS else arr
        arrays["share_head"] = np.full_like(arrays["share_head"], -1)
        arrays["nshared"] = np.zeros_like(arrays["nshared"])
        arrays["dense_n"] = np.array([pool.dense_n], np.int64)
        arrays["sparse_pages"] = pool.slots.pages()
        hits = [(p, remap[r], h) for p, rs in pool.shared().items() for r, h in rs.items()]
        arrays["shares"] = np.array(hits, np.int64).reshape(-1, 3)
        extra = [(p, remap[r]) for p, rs in pool.extra.items() for r in sorted(rs)]
        arrays["extra"] = np.array(extra, np.int64).reshape(-1, 2)
        rel = [(remap[r], a) for r, lists in pool.released.items() for a in lists]
        arrays["released_req"] = np.array([r for r, _ in rel], np.int64)
        arrays["released_len"] = np.array([len(a) for _, a in rel], np.int64)
        flat = np.concatenate([np.asarray(a, np.int64) for _, a in rel]) if rel else np.zeros(0, np.int64)
        arrays["released_pages"] = flat.astype(np.int32) if not len(flat) or flat.max() < 2**31 else flat
        late = [(p, k[0], k[1], remap[w], g) for p, (k, w, g) in pool.late.items()]
        arrays["late"] = np.array(late, np.int64).reshape(-1, 5)
        ids = [state.requests[r] for r in used.tolist()]
        info["requests"] = ids
        info["tenants"] = {rid: state.tenants[rid] for rid in ids if rid is not None and rid in state.tenants}
        info["request_tenants"] = [state.request_tenants[r] for r in used.tolist()]
    return arrayfile.pack(info, arrays)


def _load(data: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """(info, arrays) of a checkpoint of any format it reads."""
    if arrayfile.is_array_file(data):
        info, arrays = arrayfile.unpack(data)
    else:  # formats 1 and 2: an .npz
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            info = json.loads(bytes(z["info"]).decode())
            arrays = {name: z[name] for name in z.files if name != "info"}
    if info.get("format_version") not in _READS:
        raise ValueError(f"checkpoint: format_version {info.get('format_version')!r}, expected one of {_READS}")
    return info, arrays


def read_info(data: bytes) -> CheckpointInfo:
    if arrayfile.is_array_file(data):
        info = arrayfile.read_info(data)
    else:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            info = json.loads(bytes(z["info"]).decode())
    return CheckpointInfo(info["cluster"], info["node"], info["boundary_ns"], info["has_pool"], info["instance"])


def restore(data: bytes, state: ReplayState) -> CheckpointInfo:
    """Load a checkpoint into a fresh ``state`` (no requests registered yet): its pool, ids and tenants."""
    assert not state.requests, "a checkpoint is restored into a fresh replay state"
    info, arrays = _load(data)
    key = (info["cluster"], info["node"])
    out = CheckpointInfo(info["cluster"], info["node"], info["boundary_ns"], info["has_pool"], info["instance"])
    if not info["has_pool"]:
        return out
    state.tenants.update(info["tenants"])
    tenants = info.get("request_tenants") or [
        info["tenants"].get(rid) if rid is not None else None for rid in info["requests"]
    ]
    for rid, tenant in zip(info["requests"], tenants):
        if tenant is not None:
            state.named[(rid, tenant)] = -1  # named before anything the restored replay reads
        state.req(rid, tenant)
    raw = {spec.name: arrays[spec.name] for spec in PAGE_ARRAYS}  # each array its own (writable) buffer
    if "dense_n" in arrays:  # where the sparse pages live (a checkpoint without them: every page dense)
        pool = PageState.restore(raw, int(arrays["dense_n"][0]), arrays["sparse_pages"].tolist())
    else:
        pool = PageState(**raw)
    restore_shares(pool, arrays["shares"])
    for p, r in arrays["extra"].tolist():
        pool.extra.setdefault(p, set()).add(r)
    flat, ends = arrays["released_pages"], np.cumsum(arrays["released_len"]).tolist()
    released: OrderedDict[int, list[np.ndarray]] = OrderedDict()
    for r, lo, hi in zip(arrays["released_req"].tolist(), [0, *ends], ends):
        released.setdefault(r, []).append(flat[lo:hi])  # views of one array, in release order
    pool.released = released
    pool.released_pages = int(arrays["released_len"].sum())
    pool.late = {p: ((k0, k1), w, g) for p, k0, k1, w, g in arrays["late"].tolist()}
    state.pools[key] = pool
    state.pool_instance[key] = info["instance"]
    return out
