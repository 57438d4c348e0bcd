"""``kvtrail lake verify``: every file of a lake against its manifest, the manifests' own chain, and the
batches' hash chain recomputed from the files.

A file the manifest lists that is gone (deleted), whose SHA-256 differs (edited) or that the manifest
does not list (extra) is named; so is a checkpoint that does not read whole (its header and every array
decompressed, in any checkpoint format) or that describes another partition than the manifest says, a
manifest whose predecessor is missing or altered, an unsigned or badly signed manifest when a public key
is given, and every break of a producer's chain (the store's own check,
:func:`kvtrail.audit.verify.verify_store`, run on the lake's files).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from kvtrail.audit.chain import SignatureChecker
from kvtrail.audit.lake import arrayfile
from kvtrail.audit.lake.catalog import STORE_TABLES, open_catalog
from kvtrail.audit.lake.fs import LakeFS
from kvtrail.audit.lake.manifest import (
    MANIFEST_DIR,
    FileEntry,
    LakeManifest,
    check_signature,
    manifest_name,
    manifest_numbers,
    parse_manifest,
    require_manifest,
)
from kvtrail.audit.lake.partition import HOUR_NS
from kvtrail.audit.verify import verify_store


@dataclass
class LakeVerifyReport:
    """What ``kvtrail lake verify`` found; ``ok`` when there are no problems."""

    manifest: int = 0
    files_checked: int = 0
    batches_checked: int = 0
    problems: list[str] = field(default_factory=list)
    damaged: set[str] = field(default_factory=set)  # listed files missing or altered

    @property
    def ok(self) -> bool:
        return not self.problems


def check_files(lake: LakeFS, m: LakeManifest, report: LakeVerifyReport, *, extras: bool = True) -> None:
    """Listed files against their SHA-256 (and, with ``extras``, files the manifest does not list)."""
    present = {p for p in lake.list() if not p.startswith(MANIFEST_DIR + "/")}
    for rel, entry in sorted(m.files.items()):
        if rel not in present:
            report.problems.append(f"missing file: {rel} (the manifest lists it)")
            report.damaged.add(rel)
            continue
        report.files_checked += 1
        data = lake.read(rel)
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            report.problems.append(f"altered file: {rel} (SHA-256 differs from the manifest)")
            report.damaged.add(rel)
        elif entry.table == "checkpoint":
            bad = _checkpoint_problem(data, entry)
            if bad:
                report.problems.append(f"unreadable checkpoint: {rel} ({bad})")
                report.damaged.add(rel)
    if extras:
        for rel in sorted(present - set(m.files)):
            report.problems.append(f"extra file: {rel} (not in the manifest)")


def _checkpoint_problem(data: bytes, entry: FileEntry) -> str | None:
    """What is wrong with a checkpoint whose bytes match the manifest (None: nothing): it must read whole and
    name the partition's node and the hour's start."""
    info, bad = arrayfile.check(data)
    if info is None:
        return bad
    want = {"cluster": entry.cluster, "node": entry.node, "boundary_ns": (entry.hour or 0) * HOUR_NS}
    got = {k: info.get(k) for k in want}
    if got != want:
        return f"it describes {got}, the manifest {want}"
    return None


def _check_manifests(lake: LakeFS, report: LakeVerifyReport) -> None:
    numbers = manifest_numbers(lake)
    expected = list(range(1, numbers[-1] + 1)) if numbers else []
    for n in sorted(set(expected) - set(numbers)):
        report.problems.append(f"missing manifest: {manifest_name(n)}")
    prev_raw = None
    for n in expected:
        if n not in numbers:
            prev_raw = None
            continue
        raw = lake.read(manifest_name(n))
        doc = parse_manifest(raw, manifest_name(n))
        want = doc.prev_manifest_sha256
        if prev_raw is not None and want != hashlib.sha256(prev_raw).hexdigest():
            report.problems.append(f"{manifest_name(n)}: its predecessor {manifest_name(n - 1)} was altered")
        if n == 1 and want is not None:
            report.problems.append(f"{manifest_name(n)}: names a predecessor, none is there")
        prev_raw = raw


def _anchored(p, anchors: dict) -> bool:
    """The one problem verify_store reports for a chain exported from a later batch (``--since``)."""
    a = anchors.get(str(p.producer_id))
    return a is not None and p.batch_no == a["batch_no"] and p.what.startswith("missing link: batch 0 ")


def _anchored_links(con, anchors: dict) -> list[str]:
    """Links of chains that start at an anchor: verify_store stops checking links after its first break."""
    out = []
    for pid, a in sorted(anchors.items()):
        rows = con.execute(
            "SELECT batch_no, prev_digest, digest FROM batches WHERE producer_id = ? ORDER BY batch_no", [int(pid)]
        ).fetchall()
        expect_no, prev = a["batch_no"], bytes.fromhex(a["prev_digest"])
        for no, prev_digest, digest in rows:
            if no != expect_no or bytes(prev_digest) != prev:
                out.append(
                    f"chain: producer {pid} batch {no}: broken link after the exported start (batch {a['batch_no']})"
                )
                break
            expect_no, prev = no + 1, bytes(digest)
    return out


def verify_lake(url: str, *, checker: SignatureChecker | None = None) -> LakeVerifyReport:
    """Check the lake at ``url`` (see the module doc)."""
    lake = LakeFS.open(url)
    m = require_manifest(lake)
    report = LakeVerifyReport(manifest=m.number)
    _check_manifests(lake, report)
    if checker is not None:
        bad = check_signature(m, checker)
        if bad:
            report.problems.append(f"{manifest_name(m.number)}: {bad}")
    check_files(lake, m, report)
    usable = {t: sorted(p for p, f in m.files_of(t).items() if p not in report.damaged) for t in STORE_TABLES}
    con = open_catalog(lake, usable)
    try:
        chain = verify_store(con)
        report.batches_checked = chain.batches_checked
        anchors = m.doc.anchors
        report.problems.extend(f"chain: {p}" for p in chain.problems if not _anchored(p, anchors))
        report.problems.extend(_anchored_links(con, anchors))
        heads = {
            str(pid): (no, bytes(d).hex())
            for pid, no, d in con.execute(
                "SELECT producer_id, batch_no, digest FROM batches "
                "QUALIFY row_number() OVER (PARTITION BY producer_id ORDER BY batch_no DESC) = 1"
            ).fetchall()
        }
    finally:
        con.close()
    for pid, head in sorted(m.doc.chain_heads.items()):
        if heads.get(pid) != (head["batch_no"], head["digest"]):
            report.problems.append(
                f"chain head of producer {pid}: the files end at {heads.get(pid, ('nothing',))[0]}, "
                f"the manifest says batch {head['batch_no']}"
            )
    return report
