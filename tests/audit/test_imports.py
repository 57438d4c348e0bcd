"""The recorder hands events to its writer through the buffer: neither the writer nor the buffer imports
the recorder, not even inside a function (tests/test_layout.py checks the whole package for circles)."""

from tests.test_layout import GRAPH


def _audit_imports(module: str) -> set[str]:
    """Sibling modules of kvtrail.audit that ``module`` imports anywhere in its source."""
    return {m.split(".")[2] for m in GRAPH[f"kvtrail.audit.{module}"] if m.startswith("kvtrail.audit.")}


def test_the_writer_and_the_buffer_do_not_import_the_recorder():
    assert "recorder" not in _audit_imports("writer")
    assert "recorder" not in _audit_imports("buffer")
    assert {"writer", "buffer", "contract"} <= _audit_imports("recorder")


def test_the_contract_needs_neither_the_recorder_nor_the_store():
    assert _audit_imports("contract") <= {"events"}
