"""The Report view's work: the disclosure report of a window, as the CLI's ``forensics report`` writes it
(on a snapshot of the store, with the uploaded ``incident.yaml``), zipped for download, and
``verify-report``'s verdict on it."""

from __future__ import annotations

import io
import tempfile
import zipfile
from pathlib import Path

from kvtrail import forensics as fx
from kvtrail.answers.remote import RemoteSource
from kvtrail.answers.store import StoreSource
from kvtrail.audit.snapshot import open_snapshot
from kvtrail.errors import KvtrailError
from kvtrail.forensics.options import ReportOptions
from kvtrail.report.build import build_report, write_report
from kvtrail.report.context import load_context
from kvtrail.report.verify import verify_report

MAX_CONTEXT_BYTES = 1 << 20  # the CLI's limit on incident.yaml


def report_of(src: StoreSource | RemoteSource, w: fx.Window, context_yaml: bytes | None) -> tuple[bytes, dict, str]:
    """The report of the window from the view's source: a service writes it on its own snapshot; a store
    file is reported here, on a snapshot of the file."""
    if isinstance(src, RemoteSource):
        return src.report(w, context_yaml)
    return local_report(src.db, w, context_yaml)


def local_report(db: str, w: fx.Window, context_yaml: bytes | None) -> tuple[bytes, dict, str]:
    """(zip of the report folder, the report's counts, the verdict line) for the window of ``w``."""
    if w.from_ns is None or w.to_ns is None:
        raise KvtrailError("window: a report needs a bounded window (from and to)")
    with tempfile.TemporaryDirectory(prefix="kvtrail-report-") as tmp:
        ctx = None
        if context_yaml is not None:
            if len(context_yaml) > MAX_CONTEXT_BYTES:
                raise KvtrailError("incident.yaml: larger than 1 MiB")
            path = Path(tmp) / "incident.yaml"
            path.write_bytes(context_yaml)
            ctx = load_context(path)
        options = ReportOptions(w.from_ns, w.to_ns, ctx.exclusions if ctx else fx.Exclusions())
        con, heads = open_snapshot(db)
        try:
            report = build_report(con, options, ctx, heads)
        finally:
            con.close()
        out = Path(tmp) / "report"
        write_report(report, out, Path(db).name, protected=(db,))
        check = verify_report(out, db)
        verdict = (
            "confirmed: the report matches the store (results digest, chain heads, files)"
            if check.ok
            else "NOT confirmed: " + "; ".join(check.problems)
        )
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
            for f in sorted(out.iterdir()):
                z.write(f, f"report/{f.name}")
        return buf.getvalue(), report.counts, verdict
