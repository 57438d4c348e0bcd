"""The event model's published forms agree with the code: shipped JSON Schema, docs/events.md, validator."""

import json
from pathlib import Path

import jsonschema
import pytest

from kvtrail.audit.batch import from_dicts, to_dicts
from kvtrail.audit.events import ALL_FIELDS, KINDS
from kvtrail.audit.spec import json_schema, render_markdown, shipped_schema
from kvtrail.errors import ValidationError
from tests.audit.test_store import _all_kinds
from tests.conftest import alloc, config

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_schema_is_the_generated_one():
    assert shipped_schema() == json.loads(json.dumps(json_schema()))


def test_docs_carry_the_generated_reference():
    text = (ROOT / "docs" / "events.md").read_text()
    marker = "<!-- generated: kvtrail audit schema --markdown -->"
    start = text.index(marker) + len(marker + "\n")
    end = text.index("<!-- end generated -->")
    assert text[start:end].strip() == render_markdown().strip(), "regenerate with: kvtrail audit schema --markdown"
    for f in ALL_FIELDS:
        assert f"`{f.name}`" in text or f"`producer.{f.name}`" in text or f"`request.{f.name}`" in text
    for k in KINDS:
        assert f"`{k}`" in text


def test_every_valid_event_passes_the_json_schema():
    schema = shipped_schema()
    events = [config(0, checksum_enabled=True)] + _all_kinds()
    from_dicts(events)  # the validator's type layer accepts them too
    for e in to_dicts(from_dicts(events)):
        jsonschema.validate(e, schema)


@pytest.mark.parametrize(
    "bad",
    [
        dict(alloc(1, [1]), purpose="because"),
        dict(alloc(1, [0])),
        {k: v for k, v in alloc(1, [1]).items() if k != "purpose"},
        dict(alloc(1, [1]), schema_version=2),
        dict(alloc(1, [1]), prompt="text"),
        dict(alloc(1, [1]), http_status=200),
    ],
)
def test_schema_and_validator_both_reject(bad, store):
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, shipped_schema())
    store.append(from_dicts([config(0)]))
    with pytest.raises(ValidationError):
        store.append(from_dicts([bad]))
