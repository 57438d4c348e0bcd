"""The report manifest (``report.json``): the options that decide the numbers (window, exclusions,
baseline, rules), the kvtrail version, each producer's audit chain head at report time (latest batch
number and digest), a SHA-256 of the canonical query results and a SHA-256 of every file written; for a
report on an audit lake, also the lake manifest it was built from (number, SHA-256, chain heads).
:mod:`kvtrail.report.verify` checks a report against it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kvtrail.errors import KvtrailError
from kvtrail.timeutil import format_utc

MANIFEST = "report.json"
FORMAT = "kvtrail-report/1"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(report, out: Path, files: list[str], store_name: str) -> dict:
    """Write ``report.json`` beside the files (it lists their hashes, so it is written last)."""
    o = report.options
    doc = {
        "format": FORMAT,
        "kvtrail_version": report.version,
        "generated_utc": format_utc(report.generated_ns),
        "store": store_name,
        "window": {"from_utc": format_utc(o.from_ns), "to_utc": format_utc(o.to_ns)},
        "options": o.to_dict(),
        "context": report.context.to_dict() if report.context else None,
        "counts": report.counts,
        "chain_heads": list(report.chain_heads),
        "coverage_gaps": report.coverage.to_dicts(),
        "results_digest": report.results_digest(),
        "results_digest_method": "sha256 of sorted-key compact JSON of the results (rows sorted)",
        "files": {name: sha256_file(out / name) for name in sorted(files)},
    }
    if report.lake is not None:  # a report on an audit lake: the manifest it was built from
        doc["lake"] = report.lake
    (out / MANIFEST).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return doc


def load_manifest(report_dir: str | Path) -> dict:
    d = Path(report_dir)
    if not d.is_dir():
        raise KvtrailError(f"DIR: report directory not found: {report_dir}")
    path = d / MANIFEST
    if not path.is_file():
        raise KvtrailError(f"DIR: no {MANIFEST} in {report_dir} (not a kvtrail report directory)")
    try:
        doc = json.loads(path.read_text())
    except ValueError:
        raise KvtrailError(f"{MANIFEST}: not valid JSON") from None
    missing = [k for k in ("format", "options", "chain_heads", "results_digest", "files") if k not in doc]
    if doc.get("format") != FORMAT or missing:
        raise KvtrailError(f"{MANIFEST}: field '{missing[0] if missing else 'format'}': not a {FORMAT} manifest")
    return doc
