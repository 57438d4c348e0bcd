"""Machine- and human-readable forms of the event model: JSON Schema and Markdown tables.

Both are generated from :mod:`kvtrail.audit.events`. The JSON Schema is shipped in the package
(``schemas/events-v1.json``) for remote producers; a test checks the shipped file and
``docs/events.md`` match what this module generates.
"""

from __future__ import annotations

import json
from importlib import resources

from kvtrail.audit.events import (
    ENVELOPE_FIELDS,
    FIELDS,
    KINDS,
    PAYLOAD_FIELDS,
    PRODUCER_FIELDS,
    REQUEST_FIELDS,
    SCHEMA_VERSION,
    VALUE_DOCS,
    FieldSpec,
)

SCHEMA_FILE = f"events-v{SCHEMA_VERSION}.json"
_UINT64_MAX = 2**64 - 1
_INT64_MAX = 2**63 - 1


def _field_schema(f: FieldSpec) -> dict:
    s: dict[str, object]
    if f.type in ("str",):
        s = {"type": "string"}
    elif f.type == "enum":
        s = {"type": "string", "enum": list(f.choices)}
    elif f.type == "bool":
        s = {"type": "boolean"}
    elif f.type == "int32":
        s = {"type": "integer", "maximum": 2**31 - 1}
    elif f.type == "int64":
        s = {"type": "integer", "maximum": _INT64_MAX}
    elif f.type == "uint64":
        s = {"type": "integer", "minimum": 0, "maximum": _UINT64_MAX}
    elif f.type == "pages":
        s = {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 2**31 - 1}}
    elif f.type == "u64list":
        s = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": _UINT64_MAX}}
    else:
        assert f.type == "i64list", f"no JSON Schema for field type {f.type}"
        s = {"type": "array", "items": {"type": "integer", "minimum": -(2**63), "maximum": _INT64_MAX}}
    if f.minimum is not None and f.type in ("int32", "int64", "uint64"):
        s["minimum"] = f.minimum
    if f.type in ("str",) and f in PRODUCER_FIELDS:
        s["minLength"] = 1
    s["description"] = f.doc + "".join(f" {value}: {doc}" for value, doc in _value_docs(f))
    return s


def _value_docs(f: FieldSpec) -> list[tuple[str, str]]:
    """(value, meaning) of each choice of ``f`` that :data:`VALUE_DOCS` documents (all of them or none)."""
    docs = VALUE_DOCS.get(f.name, {})
    assert not docs or tuple(docs) == f.choices, f"VALUE_DOCS['{f.name}'] must list exactly its choices, in order"
    return list(docs.items())


def json_schema() -> dict:
    """The JSON Schema (draft 2020-12) of one wire event (one line of JSON lines)."""
    envelope = {f.name: _field_schema(f) for f in ENVELOPE_FIELDS if f.name not in {p.name for p in PRODUCER_FIELDS}}
    envelope["schema_version"] = {"const": SCHEMA_VERSION, "description": FIELDS["schema_version"].doc}
    producer = {
        "type": "object",
        "additionalProperties": False,
        "required": [f.name for f in PRODUCER_FIELDS],
        "properties": {f.name: _field_schema(f) for f in PRODUCER_FIELDS},
    }
    variants = []
    for kind in KINDS.values():
        req_fields = [f for f in REQUEST_FIELDS if f.name in kind.allowed]
        props = dict(envelope)
        props["kind"] = {"const": kind.name, "description": kind.doc}
        props["producer"] = {"$ref": "#/$defs/producer"}
        required = ["schema_version", "producer", "seq", "wall_ns", "mono_ns", "kind"]
        if req_fields:
            props["request"] = {
                "type": "object",
                "additionalProperties": False,
                "required": [f.name for f in req_fields if f.name in kind.required],
                "properties": {f.name: _field_schema(f) for f in req_fields},
            }
            if any(f.name in kind.required for f in req_fields):
                required.append("request")
        for f in PAYLOAD_FIELDS:
            if f.name in kind.allowed:
                props[f.name] = _field_schema(f)
                if f.name in kind.required:
                    required.append(f.name)
        variants.append({"type": "object", "additionalProperties": False, "required": required, "properties": props})
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://kvtrail.dev/schemas/{SCHEMA_FILE}",
        "title": f"kvtrail audit event, schema version {SCHEMA_VERSION}",
        "$defs": {"producer": producer},
        "oneOf": variants,
    }


def shipped_schema() -> dict:
    """The JSON Schema file shipped inside the package."""
    return json.loads(resources.files("kvtrail.audit").joinpath("schemas", SCHEMA_FILE).read_text())


def render_markdown() -> str:
    """Markdown tables of every field and every kind (the generated part of docs/events.md)."""
    lines = ["### Fields", "", "| field | type | meaning |", "|---|---|---|"]
    for group, fields in (("envelope", ENVELOPE_FIELDS), ("request", REQUEST_FIELDS), ("payload", PAYLOAD_FIELDS)):
        for f in fields:
            type_ = f.type + (f" ({' / '.join(f.choices)})" if f.choices and f.name != "kind" else "")
            prefix = "producer." if f in PRODUCER_FIELDS else ("request." if group == "request" else "")
            lines.append(f"| `{prefix}{f.name}` | {type_} | {f.doc} |")
    lines += ["", "### Values", "", "| field | value | meaning |", "|---|---|---|"]
    for f in (*ENVELOPE_FIELDS, *REQUEST_FIELDS, *PAYLOAD_FIELDS):
        lines += [f"| `{f.name}` | `{value}` | {doc} |" for value, doc in _value_docs(f)]
    lines += ["", "### Kinds", "", "| kind | meaning | required | optional |", "|---|---|---|---|"]
    for k in KINDS.values():
        req = ", ".join(f"`{n}`" for n in k.required)
        opt = ", ".join(f"`{n}`" for n in k.optional) or "—"
        lines.append(f"| `{k.name}` | {k.doc} | {req} | {opt} |")
    return "\n".join(lines) + "\n"
