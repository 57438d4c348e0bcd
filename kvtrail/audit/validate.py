"""Validation of a whole batch before anything is written.

Every rule of the event model is checked here, vectorised over the batch, and the first violation
raises :class:`~kvtrail.errors.ValidationError` naming the event (its index in the batch), its kind,
the field and the reason. A batch is accepted whole or not at all.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrail.audit.arrowutil import INT32_MAX, flat_list, list_lengths, valid_mask
from kvtrail.audit.batch import BATCH_SCHEMA, NULLABLE_BATCH_SCHEMA
from kvtrail.audit.events import (
    ENVELOPE_NAMES,
    FIELDS,
    KIND_CODES,
    KIND_NAMES,
    KINDS,
    OPTIONAL_NAMES,
    PRODUCER_FIELDS,
    SUPPORTED_SCHEMA_VERSIONS,
    Producer,
)
from kvtrail.errors import ValidationError

PRODUCER_NAMES = tuple(f.name for f in PRODUCER_FIELDS)
_KEY_SEP = "\x1f"
# The largest pool a node_config may declare: 2^31 pages is far beyond what any GPU holds (at 16 tokens a
# page, 32 G tokens of KV). A larger pool is a broken or hostile producer, refused with its batch.
MAX_POOL_PAGES = 1 << 31


def producer_id(p: Producer) -> int:
    """Stable 63-bit id of a producer identity (the same on every machine and after export/import)."""
    key = _KEY_SEP.join(getattr(p, n) for n in PRODUCER_NAMES).encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1


@dataclass
class ProducerState:
    """What the store already knows of a producer, needed to validate its next batch."""

    last_seq: int | None = None
    pool_pages: int | None = None


@dataclass
class ValidatedBatch:
    table: pa.Table  # normalised to BATCH_SCHEMA
    kind_code: np.ndarray  # uint8 per row
    producer_ids: list[int]  # one per distinct producer, in order of first appearance
    producers: list[Producer]
    producer_index: np.ndarray  # per row: index into producer_ids
    num_page_events: int


def merge_validated(parts: Sequence[ValidatedBatch]) -> ValidatedBatch:
    """Batches validated one by one, as one batch of their producers (one stored batch each, committed
    together): their rows one after another. ValueError if two of them come from the same producer, since
    each was checked against the store as it was, not against the other."""
    if len(parts) == 1:
        return parts[0]
    ids = [pid for vb in parts for pid in vb.producer_ids]
    if len(set(ids)) != len(ids):
        raise ValueError("batches committed together must come from different producers")
    offsets = np.cumsum([0] + [len(vb.producer_ids) for vb in parts[:-1]])
    return ValidatedBatch(
        pa.concat_tables([vb.table for vb in parts]),
        np.concatenate([vb.kind_code for vb in parts]),
        ids,
        [p for vb in parts for p in vb.producers],
        np.concatenate([vb.producer_index + off for vb, off in zip(parts, offsets)]),
        sum(vb.num_page_events for vb in parts),
    )


def _column_error(t: pa.Table, field: str, reason: str, rows: np.ndarray) -> ValidationError:
    """A whole-column problem, reported at the first event it shows in (``rows``), if any."""
    if not rows.any():
        return ValidationError(field, reason)
    idx = int(np.flatnonzero(rows)[0])
    return ValidationError(field, reason, event=idx, kind=_kind_at(t, idx))


def _first_uncastable(col, type_: pa.DataType) -> np.ndarray:
    """Mask of the first row of ``col`` that does not cast to ``type_`` (only run once a cast failed)."""
    mask = np.zeros(len(col), dtype=bool)
    for i in range(len(col)):
        try:
            col.slice(i, 1).cast(type_)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            mask[i] = True
            break
    return mask


def _normalise(table: pa.Table) -> tuple[pa.Table, dict[str, str]]:
    """The batch in BATCH_SCHEMA, and the text columns that hold one value on every event (a producer's
    wire batch sends them as one-entry dictionaries: its identity, often its kind), with that value."""
    names = set(table.column_names)
    for name in table.column_names:
        if name not in FIELDS:
            raise _column_error(table, name, "unknown field", valid_mask(table.column(name)))
    for name in ENVELOPE_NAMES:
        if name not in names:
            raise _column_error(table, name, "missing (required on every event)", np.ones(table.num_rows, bool))
    arrays = []
    constant: dict[str, str] = {}
    for f in BATCH_SCHEMA:
        if f.name not in names:
            arrays.append(_nulls(table.num_rows, f.type))
            continue
        col = table.column(f.name)
        if col.type != f.type:
            if pa.types.is_dictionary(col.type):
                repeated = _repeated(col) if f.type == pa.string() else None
                if repeated is not None:
                    arrays.append(repeated[0])
                    constant[f.name] = repeated[1]
                    continue
                col = col.cast(col.type.value_type)
            try:
                col = col.cast(f.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise _column_error(
                    table,
                    f.name,
                    f"wrong type: expected {FIELDS[f.name].type}, got {col.type} ({exc})",
                    _first_uncastable(col, f.type),
                ) from None
        if isinstance(col, pa.ChunkedArray):
            col = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
        arrays.append(col)
    return pa.Table.from_arrays(arrays, schema=NULLABLE_BATCH_SCHEMA), constant


# All-null columns (those a wire batch leaves out) are slices of one kept per type, up to this many rows:
# no allocation per batch, and no call that lets the interpreter switch threads on a busy service.
_NULLS_KEPT_ROWS = 1 << 16
_NULLS: dict[pa.DataType, pa.Array] = {}


def _nulls(n: int, type_: pa.DataType) -> pa.Array:
    if n > _NULLS_KEPT_ROWS:
        return pa.nulls(n, type_)
    kept = _NULLS.get(type_)
    if kept is None:
        kept = _NULLS[type_] = pa.nulls(_NULLS_KEPT_ROWS, type_)
    return kept.slice(0, n)


def _repeated(col) -> tuple[pa.Array, str] | None:
    """A string dictionary column of one entry and no null as plain strings, and that string; None for
    any other column. Built from its bytes (what a cast computes, without a kernel call per column)."""
    if isinstance(col, pa.ChunkedArray):
        if col.num_chunks != 1:
            return None
        col = col.chunk(0)
    if not pa.types.is_string(col.type.value_type) or len(col.dictionary) != 1 or col.null_count or not len(col):
        return None
    value = col.dictionary[0].as_py()
    data = value.encode()
    n = len(col)
    if n * len(data) > INT32_MAX:
        return None
    offsets = np.arange(n + 1, dtype=np.int32) * np.int32(len(data))
    strings = pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data * n)])
    return strings, value


def _kind_at(t: pa.Table, idx: int) -> str | None:
    """The kind the event at ``idx`` claims (as sent, so an unknown kind is still named)."""
    if "kind" not in t.column_names:
        return None
    value = t.column("kind")[idx].as_py()
    return value if isinstance(value, str) else None


def _fail(mask: np.ndarray, field: str, reason: str, t: pa.Table) -> None:
    """Refuse the batch for the rows of ``mask`` (the rows that break this rule, each on its own)."""
    _fail_rows(np.flatnonzero(mask), field, reason, t)


def _fail_rows(rows: np.ndarray, field: str, reason: str, t: pa.Table) -> None:
    """Refuse the batch, naming the first of ``rows`` (ascending) and listing them all: a recorder's writer
    takes them out of its batch at once."""
    idx = int(rows[0])
    raise ValidationError(field, reason, event=idx, kind=_kind_at(t, idx), events=tuple(rows.tolist()))


def _check_envelope(t: pa.Table) -> np.ndarray:
    for name in ENVELOPE_NAMES:
        if t.column(name).null_count:  # the mask only for a column that has a null
            _fail(~valid_mask(t.column(name)), name, "missing (required on every event)", t)
    versions = t.column("schema_version").to_numpy()
    bad = ~np.isin(versions, SUPPORTED_SCHEMA_VERSIONS)
    if bad.any():
        v = int(versions[np.flatnonzero(bad)[0]])
        _fail(bad, "schema_version", f"unknown schema version {v}; supported: {list(SUPPORTED_SCHEMA_VERSIONS)}", t)
    kind_dict = pc.dictionary_encode(t.column("kind")).combine_chunks()
    known = np.array([KIND_CODES.get(k, 255) for k in kind_dict.dictionary.to_pylist()], dtype=np.uint8)
    codes = known[kind_dict.indices.to_numpy(zero_copy_only=False)] if len(known) else np.empty(0, np.uint8)
    if (codes == 255).any():
        bad = codes == 255
        name = t.column("kind")[int(np.flatnonzero(bad)[0])].as_py()
        _fail(bad, "kind", f"unknown kind {name!r}; known: {', '.join(KIND_NAMES)}", t)
    return codes


_REQUIRED = {n: np.array([n in KINDS[k].required for k in KIND_NAMES], dtype=bool) for n in OPTIONAL_NAMES}
_ALLOWED = {n: np.array([n in KINDS[k].allowed for k in KIND_NAMES], dtype=bool) for n in OPTIONAL_NAMES}


def _check_kind_fields(t: pa.Table, codes: np.ndarray) -> None:
    nkinds = len(KIND_NAMES)
    counts = np.bincount(codes, minlength=nkinds)
    present = counts > 0
    for name in OPTIONAL_NAMES:
        col = t.column(name)
        required, allowed = _REQUIRED[name], _ALLOWED[name]
        if col.null_count == t.num_rows:  # absent everywhere: only "required" can fail
            if (required & present).any():
                _fail(required[codes], name, "missing (required for this kind)", t)
            continue
        if col.null_count == 0 and allowed[present].all():  # present everywhere and allowed for every kind here
            continue
        valid = valid_mask(col)
        # Counts per kind decide; the per-row masks that name the first bad event only on a failure.
        have = np.bincount(codes[valid], minlength=nkinds)
        if (required & (have < counts)).any():
            _fail(required[codes] & ~valid, name, "missing (required for this kind)", t)
        if (~allowed & (have > 0)).any():
            _fail(~allowed[codes] & valid, name, "not allowed for this kind", t)


def _check_values(t: pa.Table, codes: np.ndarray, constant: dict[str, str] | None = None) -> None:
    # Each rule first asks a cheap whole-column question (distinct values, minimum); only a batch that
    # fails it pays for the per-row mask that names the first bad event. A column of one value on every
    # event (``constant``) is asked of that value.
    n = t.num_rows
    constant = constant or {}
    distinct: dict[str, set] = {}  # each enum column's values, for the rules below
    for name in ENVELOPE_NAMES + OPTIONAL_NAMES:
        spec = FIELDS[name]
        col = t.column(name)
        if col.null_count == n:
            continue
        if spec.type == "enum" and spec.choices:
            distinct[name] = {constant[name]} if name in constant else set(pc.unique(col).drop_null().to_pylist())
            if distinct[name] <= set(spec.choices):
                continue
            bad = pc.is_valid(col).to_numpy(zero_copy_only=False) & ~pc.fill_null(
                pc.is_in(col, value_set=pa.array(spec.choices)), True
            ).to_numpy(zero_copy_only=False)
            value = col[int(np.flatnonzero(bad)[0])].as_py()
            _fail(bad, name, f"{value!r} is not one of {', '.join(spec.choices)}", t)
        elif spec.type == "str" and name in PRODUCER_NAMES:
            # lengths, not a hash of every value
            empty = constant[name] == "" if name in constant else pc.min(pc.binary_length(col)).as_py() == 0
            if empty:
                _fail(
                    pc.equal(pc.utf8_length(col), 0).to_numpy(zero_copy_only=False),
                    name,
                    "must be a non-empty string",
                    t,
                )
        elif spec.minimum is not None and spec.type in ("int32", "int64"):
            low = pc.min(col).as_py()
            if low is not None and low < spec.minimum:
                bad = pc.fill_null(pc.less(col, spec.minimum), False).to_numpy(zero_copy_only=False)
                _fail(bad, name, f"must be >= {spec.minimum}, got {col[int(np.flatnonzero(bad)[0])].as_py()}", t)
    for kind in KINDS.values():
        for a, b in kind.same_length:
            if t.column(a).null_count == n or t.column(b).null_count == n:
                continue
            la, lb = pc.list_value_length(t.column(a)), pc.list_value_length(t.column(b))
            differ = pc.fill_null(pc.not_equal(la, lb), False).to_numpy(zero_copy_only=False)
            bad = (codes == KIND_CODES[kind.name]) & differ
            if bad.any():
                _fail(bad, b, f"must have one entry per entry of '{a}'", t)
    if "prefix_hit" in distinct.get("purpose", ()):
        prefix_hit = (codes == KIND_CODES["pages_allocated"]) & (
            pc.fill_null(pc.equal(t.column("purpose"), "prefix_hit"), False).to_numpy(zero_copy_only=False)
        )
        no_hashes = prefix_hit & ~valid_mask(t.column("block_hashes"))
        if no_hashes.any():
            _fail(no_hashes, "block_hashes", "required when purpose is prefix_hit", t)
    if t.column("token_end").null_count < n:
        less = pc.less(t.column("token_end"), t.column("token_start"))
        if pc.any(less).as_py():  # nulls skipped: only a pair with both values can be backwards
            _fail(pc.fill_null(less, False).to_numpy(zero_copy_only=False), "token_end", "must be >= token_start", t)
    _check_pool(t, codes)
    for name in ("pages", "dst_pages", "page_digests", "block_hashes"):
        col = t.column(name)
        flat = pc.list_flatten(col)
        if flat.null_count:
            lengths = list_lengths(col)
            row_of = np.repeat(np.arange(t.num_rows), lengths)
            r = row_of[np.flatnonzero(~valid_mask(flat))[0]]
            _fail(np.arange(t.num_rows) == r, name, "list entries must not be null", t)


def _check_pool(t: pa.Table, codes: np.ndarray) -> None:
    """A node_config's pool must be plausible: at most MAX_POOL_PAGES pages, and pool_pages the whole
    pages of pool_tokens (``pool_tokens // page_size``, as SGLang sizes its page allocator)."""
    is_config = codes == KIND_CODES["node_config"]
    if not is_config.any():
        return
    rows = np.flatnonzero(is_config)  # the kind's required fields are present on these rows
    idx = pa.array(rows)
    pages = t.column("pool_pages").take(idx).to_numpy(zero_copy_only=False).astype(np.int64)
    tokens = t.column("pool_tokens").take(idx).to_numpy(zero_copy_only=False).astype(np.int64)
    size = t.column("page_size").take(idx).to_numpy(zero_copy_only=False).astype(np.int64)
    mask = np.zeros(t.num_rows, bool)
    huge = pages > MAX_POOL_PAGES
    if huge.any():
        mask[rows[np.flatnonzero(huge)[0]]] = True
        _fail(
            mask, "pool_pages", f"implausible pool of {int(pages[huge][0])} pages (at most {MAX_POOL_PAGES} = 2^31)", t
        )
    whole = tokens // size
    bad = pages != whole
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        mask[rows[i]] = True
        _fail(
            mask,
            "pool_pages",
            f"{int(pages[i])} pages do not match pool_tokens {int(tokens[i])} at page_size "
            f"{int(size[i])} (expected pool_tokens // page_size = {int(whole[i])})",
            t,
        )


def _group_producers(
    t: pa.Table, constant: dict[str, str] | None = None
) -> tuple[list[int], list[Producer], np.ndarray]:
    if t.num_rows and constant and all(n in constant for n in PRODUCER_NAMES):  # one identity, sent once
        p = Producer(*(constant[n] for n in PRODUCER_NAMES))
        return [producer_id(p)], [p], np.zeros(t.num_rows, np.int64)
    if t.num_rows:
        # The common batch has one producer: compare each identity column with its first value (no
        # hashing of joined keys). Nulls were refused by the envelope check.
        first = [t.column(n)[0] for n in PRODUCER_NAMES]
        if all(pc.all(pc.equal(t.column(n), v)).as_py() for n, v in zip(PRODUCER_NAMES, first)):
            p = Producer(*(v.as_py() for v in first))
            return [producer_id(p)], [p], np.zeros(t.num_rows, np.int64)
    key = pc.binary_join_element_wise(*[t.column(n) for n in PRODUCER_NAMES], _KEY_SEP)
    enc = pc.dictionary_encode(key).combine_chunks()
    producers = [Producer(*k.split(_KEY_SEP)) for k in enc.dictionary.to_pylist()]
    return [producer_id(p) for p in producers], producers, enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)


@dataclass(frozen=True)
class Prechecked:
    """A batch that passed the rules needing nothing of the store (:func:`precheck_batch`): normalised,
    with its kinds and producers. :func:`validate_batch` takes it and checks only the rest."""

    table: pa.Table  # normalised to BATCH_SCHEMA
    kind_code: np.ndarray
    producer_ids: list[int]
    producers: list[Producer]
    producer_index: np.ndarray


def precheck_batch(table: pa.Table) -> Prechecked:
    """The rules that need nothing of the store: schema, envelope, kind fields and values (ValidationError
    naming the event and field). A service runs them where the request arrives, so the store's one writer
    only checks what depends on the store (sequence numbers, pool bounds)."""
    t, constant = _normalise(table)
    codes = _check_envelope(t)
    _check_kind_fields(t, codes)
    _check_values(t, codes, constant)
    return Prechecked(t, codes, *_group_producers(t, constant))


def validate_batch(table: pa.Table | Prechecked, state: dict[int, ProducerState]) -> ValidatedBatch:
    """Check every rule; return the normalised batch grouped by producer, or raise ValidationError.

    ``table`` may be a batch :func:`precheck_batch` passed (then only the rules that read ``state`` run
    here). ``state`` maps producer id to what the store already holds for it (last sequence number, pool
    size from its latest node_config). It is not modified.
    """
    pre = table if isinstance(table, Prechecked) else precheck_batch(table)
    total_pages = _check_store_rules(pre, state)
    return ValidatedBatch(pre.table, pre.kind_code, pre.producer_ids, pre.producers, pre.producer_index, total_pages)


def sort_batch(table: pa.Table, state: dict[int, ProducerState]) -> tuple[ValidatedBatch, Callable[[], None]]:
    """A batch as :func:`validate_batch` returns it, having checked only what sorting its rows needs
    (schema, envelope, kinds, producers), and the check of every other rule, to run before it commits.

    The check raises the ValidationError :func:`validate_batch` would have raised (the rules run in the
    same order). ``state`` is read when the check runs: it must not change before then.
    """
    t, constant = _normalise(table)
    codes = _check_envelope(t)
    pids, producers, pindex = _group_producers(t, constant)
    pre = Prechecked(t, codes, pids, producers, pindex)

    def check() -> None:
        _check_kind_fields(t, codes)
        _check_values(t, codes, constant)
        _check_store_rules(pre, state)

    return ValidatedBatch(t, codes, pids, producers, pindex, int(list_lengths(t.column("pages")).sum())), check


def _check_store_rules(pre: Prechecked, state: dict[int, ProducerState]) -> int:
    """The rules that read ``state`` (sequence numbers, pool bounds of page ids); the batch's page-events."""
    t, codes, pids, pindex = pre.table, pre.kind_code, pre.producer_ids, pre.producer_index
    seq = t.column("seq").to_numpy(zero_copy_only=False).astype(np.uint64, copy=False)
    is_config = codes == KIND_CODES["node_config"]
    # Read as float with NaN for null: only rows of a node_config are looked at, and those carry one.
    pool = t.column("pool_pages").to_numpy(zero_copy_only=False) if is_config.any() else None
    bound = np.full(t.num_rows, -1, dtype=np.int64)  # -1: pool size unknown
    single = len(pids) == 1
    for g, pid in enumerate(pids):
        rows = np.arange(t.num_rows) if single else np.flatnonzero(pindex == g)
        st = state.get(pid, ProducerState())
        s = seq if single else seq[rows]
        if len(s) > 1 and not (s[1:] > s[:-1]).all():
            bad_at = rows[1:][~(s[1:] > s[:-1])][0]
            mask = np.zeros(t.num_rows, dtype=bool)
            mask[bad_at] = True
            _fail(mask, "seq", f"sequence number going backwards or repeated ({int(seq[bad_at])})", t)
        if st.last_seq is not None and len(s) and int(s[0]) <= st.last_seq:
            reason = f"sequence number going backwards: {int(s[0])} <= last stored {st.last_seq}"
            _fail_rows(rows[s <= st.last_seq], "seq", reason, t)  # every event numbered at or below it
        # Pool bound per row: the latest node_config at or before it, else what the store knows.
        known = st.pool_pages if st.pool_pages is not None else -1
        cfg = is_config if single else is_config[rows]
        if not cfg.any():  # no node_config in the batch: the pool size the store knows
            bound[rows] = known
            continue
        assert pool is not None, "pool_pages is read whenever the batch holds a node_config"
        cfg_pos = np.where(cfg, np.arange(len(rows)), -1)
        last_cfg = np.maximum.accumulate(cfg_pos) if len(rows) else cfg_pos
        b = np.where(last_cfg >= 0, pool[rows[np.maximum(last_cfg, 0)]], known)
        bound[rows] = np.nan_to_num(b.astype(np.float64), nan=-1).astype(np.int64)
    total_pages = 0
    for name in ("pages", "dst_pages"):
        flat, offsets = flat_list(t.column(name))
        lengths = np.diff(offsets)
        if name == "pages":
            total_pages = int(lengths.sum())
        if flat.size == 0:
            continue
        nonempty = np.flatnonzero(lengths)
        starts = offsets[:-1][nonempty]
        # One whole-batch minimum (a vectorised pass) decides the common case; only a batch that fails
        # it pays for per-list minima (reduceat), which name the first bad event.
        if flat.min() < 1:
            lo = np.minimum.reduceat(flat, starts)
            low = lo < 1
            _fail_rows(
                nonempty[low],
                name,
                f"page id {int(lo[low][0])} out of pool (page ids start at 1; 0 is the padding page)",
                t,
            )
        if name == "pages":
            row_bound = bound[nonempty]
            if len(row_bound) and row_bound.min() >= 0 and flat.max() <= row_bound.min():
                continue  # every page within the smallest pool bound of the batch
            unknown = row_bound < 0
            if unknown.any():
                _fail_rows(  # each row's bound is its own: every one of them is refused
                    nonempty[unknown],
                    name,
                    "pool size unknown: the producer has no node_config event before this one",
                    t,
                )
            hi = np.maximum.reduceat(flat, starts)
            high = hi > row_bound
            if high.any():
                i = np.flatnonzero(high)[0]
                _fail_rows(
                    nonempty[high],
                    name,
                    f"page id {int(hi[i])} out of pool (pool has {int(row_bound[i])} pages)",
                    t,
                )
    return total_pages
