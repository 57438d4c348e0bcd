"""Reading an ``audit export`` of format 1, what kvtrail wrote before both exports shared the lake's layout.

Format 1 is a folder with ``manifest.json`` (``format_version`` 1, the kvtrail and store format, the
export time, row counts per table and the chain head per producer), ``events/`` and ``page_runs/``
partitioned ``date=YYYY-MM-DD/node=<node>/*.parquet`` and one ``<table>.parquet`` per other store
table. Its files hold the same columns as a lake's, so :func:`kvtrail.audit.export.import_parquet`
loads both the same way; this module only finds the files and the manifest's expectations.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvtrail.audit.lake.catalog import STORE_TABLES
from kvtrail.audit.storefile import MIGRATABLE_FORMATS, STORE_FORMAT
from kvtrail.errors import StoreError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
PARTITIONED = ("events", "page_runs")


def is_format1(in_dir: Path) -> bool:
    return (in_dir / MANIFEST).is_file()


def check_store_format(value: object, where: str) -> None:
    """An export's files have the same columns whatever the layout of the store it came from."""
    if value not in (STORE_FORMAT, *MIGRATABLE_FORMATS):
        known = ", ".join((*MIGRATABLE_FORMATS, STORE_FORMAT))
        raise StoreError(f"{where}: export of store format {value!r}; this kvtrail reads {known}")


def read_manifest(in_dir: Path) -> dict:
    path = in_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StoreError(f"{path}: unreadable manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise StoreError(f"{path}: unsupported export format version {version!r}; this kvtrail reads {FORMAT_VERSION}")
    check_store_format(manifest.get("store_format"), str(path))
    counts, heads = manifest.get("row_counts"), manifest.get("chain_heads")
    if not isinstance(counts, dict) or set(counts) != set(STORE_TABLES) or not isinstance(heads, dict):
        raise StoreError(
            f"{path}: row_counts must name exactly the tables {', '.join(STORE_TABLES)}, and chain_heads must be given"
        )
    return manifest


def files(in_dir: Path, table: str) -> list[str]:
    if table in PARTITIONED:
        return sorted(str(p) for p in (in_dir / table).glob("date=*/node=*/*.parquet"))
    path = in_dir / f"{table}.parquet"
    if not path.is_file():
        raise StoreError(f"{in_dir} is not a complete export: {path.name} is missing")
    return [str(path)]
