"""Enum values whose name does not say enough are documented once, in the registry, and reach both the
generated docs/events.md and the shipped JSON Schema."""

from pathlib import Path

from kvtrail.audit.events import FIELDS, TRANSFER_STATUSES, VALUE_DOCS
from kvtrail.audit.spec import render_markdown, shipped_schema

ROOT = Path(__file__).resolve().parents[2]
F2 = (
    "Forensics (F2) compares what decode reserved, what prefill sent and what landed (`num_tokens` of the "
    "receipt) whatever the status; the status is evidence of whether decode detected it."
)


def test_every_transfer_status_is_documented():
    assert (
        tuple(VALUE_DOCS["status"])
        == TRANSFER_STATUSES
        == ("ok", "failed", "mismatch", "aborted", "timeout", "unverified")
    )
    for field, docs in VALUE_DOCS.items():
        assert tuple(docs) == FIELDS[field].choices
        assert all(doc.strip() for doc in docs.values())


def test_status_meanings_are_in_the_markdown_and_docs():
    md = render_markdown()
    text = (ROOT / "docs" / "events.md").read_text()
    for value, doc in VALUE_DOCS["status"].items():
        row = f"| `status` | `{value}` | {doc} |"
        assert row in md and row in text
    assert "decode accepted it" in VALUE_DOCS["status"]["ok"]
    assert "part-way" in VALUE_DOCS["status"]["failed"]
    assert "length or checksum" in VALUE_DOCS["status"]["mismatch"]
    assert "in flight" in VALUE_DOCS["status"]["aborted"]
    assert "gave up waiting" in VALUE_DOCS["status"]["timeout"]
    assert "cannot show what landed" in VALUE_DOCS["status"]["unverified"]
    assert F2 in text


def test_status_meanings_are_in_the_json_schema():
    (variant,) = [v for v in shipped_schema()["oneOf"] if v["properties"]["kind"]["const"] == "transfer_received"]
    status = variant["properties"]["status"]
    assert status["enum"] == list(TRANSFER_STATUSES)
    assert F2 in status["description"]
    for value, doc in VALUE_DOCS["status"].items():
        assert f"{value}: {doc}" in status["description"]
