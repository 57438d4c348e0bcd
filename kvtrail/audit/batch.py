"""Columnar event batches: the Arrow form every producer path converges on.

Three ways in, one way to the store: the in-process recorder's writer, JSON lines and Arrow IPC all
produce a :class:`pyarrow.Table` with :data:`BATCH_SCHEMA` (one row per event, page lists as list
columns), which :func:`kvtrail.audit.validate.validate_batch` checks before the store commits it.
"""

from __future__ import annotations

import io
import json
from typing import Iterable, Mapping

import pyarrow as pa
import pyarrow.compute as pc

from kvtrail.audit.arrowutil import nullable
from kvtrail.audit.events import ALL_FIELDS, ENVELOPE_NAMES, FIELDS, PRODUCER_FIELDS, REQUEST_FIELDS
from kvtrail.errors import ValidationError

_ARROW_TYPES = {
    "str": pa.string(),
    "enum": pa.string(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "uint64": pa.uint64(),
    "bool": pa.bool_(),
    "pages": pa.list_(pa.int32()),
    "u64list": pa.list_(pa.uint64()),
    "i64list": pa.list_(pa.int64()),
}


def arrow_type(type_name: str) -> pa.DataType:
    return _ARROW_TYPES[type_name]


BATCH_SCHEMA = pa.schema(
    [pa.field(f.name, arrow_type(f.type), nullable=f.name not in ENVELOPE_NAMES) for f in ALL_FIELDS]
)
# What builders produce before validation: the same columns, every one nullable.
NULLABLE_BATCH_SCHEMA = nullable(BATCH_SCHEMA)

_PRODUCER_NAMES = tuple(f.name for f in PRODUCER_FIELDS)
_REQUEST_NAMES = tuple(f.name for f in REQUEST_FIELDS)


_NULL = "must be left out when it has no value, not null"
_NESTED = {"producer": _PRODUCER_NAMES, "request": _REQUEST_NAMES}


def _flatten(event: Mapping, index: int, null_is_absent: bool) -> dict:
    """Turn one wire event (producer and request as nested objects) into flat columns.

    Errors name fields as the event schema does (``tenant_id``, not ``request.tenant_id``) and always
    carry the event's index and, when it has one, its kind.
    """
    if not isinstance(event, Mapping):
        raise ValidationError("(event)", f"must be a JSON object, got {type(event).__name__}", event=index)
    kind = event.get("kind")
    kind = kind if isinstance(kind, str) else None
    if "producer" not in event:
        raise ValidationError("producer", "missing (required on every event)", event=index, kind=kind)
    row = {}
    for key, value in event.items():
        # On the wire, absent means left out: a null there is a producer bug that would read as "absent".
        if value is None and (key in _NESTED or not null_is_absent):
            raise ValidationError(key, _NULL, event=index, kind=kind)
        if key in _NESTED:
            names = _NESTED[key]
            if not isinstance(value, Mapping):
                raise ValidationError(key, f"must be an object, got {type(value).__name__}", event=index, kind=kind)
            for sub, subval in value.items():
                if sub not in names:
                    raise ValidationError(
                        sub, f"unknown field in '{key}' (known: {', '.join(names)})", event=index, kind=kind
                    )
                if subval is None and not null_is_absent:
                    raise ValidationError(sub, _NULL, event=index, kind=kind)
                row[sub] = subval
        elif key in FIELDS and key not in _PRODUCER_NAMES and key not in _REQUEST_NAMES:
            row[key] = value
        elif key in FIELDS:
            raise ValidationError(
                key, f"belongs inside '{'producer' if key in _PRODUCER_NAMES else 'request'}'", event=index, kind=kind
            )
        else:
            raise ValidationError(key, "unknown field", event=index, kind=kind)
    return row


_TYPE_WORDS = {
    "str": "a string",
    "enum": "a string",
    "bool": "true or false",
    "int32": "an integer",
    "int64": "an integer",
    "uint64": "an integer",
    "pages": "a list of integer page ids",
    "u64list": "a list of integers",
    "i64list": "a list of integers",
}


def _check_python_type(name: str, value, index: int, kind) -> None:
    spec = FIELDS[name]
    if value is None:
        return
    if spec.type in ("str", "enum"):
        ok = isinstance(value, str)
    elif spec.type == "bool":
        ok = isinstance(value, bool)
    elif spec.is_list:
        ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    else:
        ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok:
        raise ValidationError(
            name,
            f"wrong type: expected {_TYPE_WORDS[spec.type]}, got {type(value).__name__}"
            + (" with a non-integer entry" if isinstance(value, list) else ""),
            event=index,
            kind=kind,
        )


def from_dicts(events: Iterable[Mapping], *, null_is_absent: bool = True) -> pa.Table:
    """Build a batch from wire-format events (dicts as decoded from JSON).

    Type errors are reported here with the event's index; value rules are checked by
    :func:`kvtrail.audit.validate.validate_batch`. Python callers may pass ``None`` for an absent
    field; :func:`parse_jsonl` passes ``null_is_absent=False``, since JSON input must leave it out.
    """
    columns: dict[str, list] = {f.name: [] for f in ALL_FIELDS}
    n = 0
    for i, event in enumerate(events):
        row = _flatten(event, i, null_is_absent)
        kind = row.get("kind") if isinstance(row.get("kind"), str) else None
        for name, col in columns.items():
            value = row.get(name)
            _check_python_type(name, value, i, kind)
            col.append(value)
        n += 1
    arrays = []
    for f in BATCH_SCHEMA:
        try:
            arrays.append(pa.array(columns[f.name], type=f.type))
        except (pa.ArrowInvalid, OverflowError) as exc:
            bad = first_bad_index(columns[f.name], f.type)
            kind = columns["kind"][bad] if bad is not None else None
            raise ValidationError(
                f.name,
                f"value out of range for {f.type}: {exc}",
                event=bad,
                kind=kind if isinstance(kind, str) else None,
            ) from None
    return pa.Table.from_arrays(arrays, schema=NULLABLE_BATCH_SCHEMA)


def first_bad_index(values: list, type_: pa.DataType) -> int | None:
    """Index of the first value Arrow cannot convert to ``type_`` (None if all convert)."""
    for i, v in enumerate(values):
        try:
            pa.array([v], type=type_)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
            return i
    return None


def parse_jsonl(data: bytes | str) -> pa.Table:
    """Decode JSON lines (one event per line; blank lines ignored) into a batch."""
    return parse_jsonl_lines(data)[0]


def parse_jsonl_lines(data: bytes | str) -> tuple[pa.Table, list[int]]:
    """Like :func:`parse_jsonl`, also returning the line number (from 1) of each event, so that a
    later validation error can name the line (:meth:`ValidationError.at_lines`)."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    events: list = []
    lines: list[int] = []
    # Split the bytes, not decoded text: str.splitlines would also split on U+2028 inside a JSON string.
    for lineno, line in enumerate(raw.splitlines(), 1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValidationError(
                "(json)",
                f"line {lineno} is not valid UTF-8 (byte 0x{line[exc.start]:02x} at column {exc.start + 1})",
                event=len(events),
            ) from None
        if not text.strip():
            continue
        try:
            events.append(json.loads(text))
        except json.JSONDecodeError as exc:
            raise ValidationError("(json)", f"line {lineno} is not valid JSON: {exc.msg}", event=len(events)) from None
        except RecursionError:  # e.g. 10^5 nested '[': no event nests more than two levels
            raise ValidationError(
                "(json)", f"line {lineno} nests too deeply to be an event", event=len(events)
            ) from None
        lines.append(lineno)
    try:
        return from_dicts(events, null_is_absent=False), lines
    except ValidationError as exc:
        raise exc.at_lines(lines) from None


def to_dicts(table: pa.Table) -> list[dict]:
    """Inverse of :func:`from_dicts`: wire-format events with nulls left out."""
    out = []
    for row in table.to_pylist():
        event = {}
        producer, request = {}, {}
        for name, value in row.items():
            if value is None:
                continue
            if name in _PRODUCER_NAMES:
                producer[name] = value
            elif name in _REQUEST_NAMES:
                request[name] = value
            else:
                event[name] = value
        event["producer"] = producer
        if request:
            event["request"] = request
        out.append(event)
    return out


def to_jsonl(table: pa.Table) -> str:
    return "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in to_dicts(table))


def read_ipc(data: bytes) -> pa.Table:
    """Decode an Arrow IPC stream (the bulk wire format) into a batch; ValidationError for bytes that are
    not one: random, truncated mid-message, or whose buffers do not hold what the schema says (checked in
    full, offsets and UTF-8 included, before any kernel reads them)."""
    try:
        # read in place (the table's buffers are views of ``data``, which they keep alive): a Python file
        # object would copy every message out of it first
        table = pa.ipc.open_stream(pa.py_buffer(data)).read_all()
        table.validate(full=True)
        return table
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:  # a truncated body: ArrowIOError, an OSError
        raise ValidationError("(arrow)", f"not a valid Arrow IPC stream: {exc}") from None


def wire_table(table: pa.Table) -> pa.Table:
    """The batch as a producer sends it: a column null on every event left out, and a text column that
    repeats its values (node names, kinds, tenants) dictionary-encoded. Validation reads a missing column
    as null and a dictionary column as its values, so the stored events, and their digest, are the same;
    a decode-heavy batch is about half the bytes (every all-null column still carries its value buffer)."""
    names, columns = [], []
    for name in table.column_names:
        col = table.column(name)
        if col.null_count == len(col) and len(col) and name not in ENVELOPE_NAMES:
            continue
        if pa.types.is_string(col.type) and len(col) > 1:
            encoded = pc.dictionary_encode(col)
            if isinstance(encoded, pa.ChunkedArray):
                encoded = encoded.combine_chunks()
            if 2 * len(encoded.dictionary) <= len(col):
                col = encoded
        names.append(name)
        columns.append(col)
    return pa.table(columns, names=names)


def write_ipc(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()
