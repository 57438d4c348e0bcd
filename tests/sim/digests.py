"""A content digest of an Arrow batch, for tests that pin a seeded stream's exact output."""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa

from kvtrail.audit.events import ADDED_FIELDS


def table_digest(table: pa.Table) -> str:
    """First 16 hex digits of SHA-256 over every column's name, type and values (as Python objects).

    Values, not buffers: the digest stays the same however pyarrow chunks or lays out the arrays. A
    column of a field added to the event model later (``ADDED_FIELDS``) that is null throughout is left
    out, as the store's chain digest does: the stream's content did not change.
    """
    h = hashlib.sha256()
    for name in table.column_names:
        col = table.column(name)
        if name in ADDED_FIELDS and col.null_count == len(col):
            continue
        h.update(name.encode())
        h.update(str(col.type).encode())
        h.update(json.dumps(col.to_pylist()).encode())
    return h.hexdigest()[:16]
