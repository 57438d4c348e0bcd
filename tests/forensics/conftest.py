"""Fixtures the forensics tests share."""

from __future__ import annotations

import pytest

from kvtrail.audit.store import AuditStore


@pytest.fixture
def mem_store():
    """An empty in-memory audit store."""
    s = AuditStore(":memory:")
    yield s
    s.close()
