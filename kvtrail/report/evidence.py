"""Notices that prove themselves: ``notices/<tenant>/`` beside a disclosure report, checked offline.

Each affected tenant (one that received a response built on memory it did not own, or whose data another
tenant's response read) gets a folder: its notice (``notice.md``), ``responses.json`` (per response it
received: request id, time, pages, codes; per read of its data: the reader's request as a hash, time,
pages, codes, its own requests read; each with the events its finding rests on), the evidence events
(``events.json``), the log's signed checkpoint (``checkpoint.txt``), the inclusion proofs of the batches
holding those events (``proofs.json``), and ``notice.json``: every file's SHA-256, signed with the operator's key
(``notice.sig``). Another tenant's request and tenant ids appear only as salted SHA-256 hashes.

:func:`verify_notice` needs nothing but the folder and the public key: the manifest's signature and every
file's hash (any edited value fails), the checkpoint's signature, every proof against its root, and that
each response's listed events support its finding (an event of the response's own request reading one
of its pages, and for another tenant's data, an event of another tenant on such a page).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path

import duckdb
import polars as pl

from kvtrail.audit.chain import SignatureChecker, Signer
from kvtrail.audit.note import parse_note, sign_checkpoint, verify_log_signature
from kvtrail.audit.tlog import LogView, check_inclusion_doc
from kvtrail.errors import KvtrailError
from kvtrail.forensics.findings import AFFECTED_CODES, NEVER_WRITTEN, UNKNOWN_TENANT

FILES = ("notice.md", "responses.json", "events.json", "checkpoint.txt", "proofs.json")
MANIFEST, SIGNATURE = "notice.json", "notice.sig"
_SALT = b"kvtrail-notice-id\x00"


def hashed(value: str | None) -> str | None:
    """Another tenant's identifier as a notice shows it: a salted SHA-256, never the id."""
    return None if value is None else "sha256:" + hashlib.sha256(_SALT + value.encode()).hexdigest()


def folder_name(tenant: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", tenant)[:64] or "_"
    return safe if safe == tenant else f"{safe}-{hashlib.sha256(tenant.encode()).hexdigest()[:8]}"


def _evidence_events(con: duckdb.DuckDBPyConnection, keys: set[tuple[int, int]]) -> dict[tuple[int, int], dict]:
    if not keys:
        return {}
    values = ", ".join(f"({int(p)}, {int(s)})" for p, s in sorted(keys))
    rows = con.execute(
        # A page event often carries only its request id: its tenant is the one its request's other events name.
        f"SELECT e.producer_id, e.seq, e.batch_no, e.kind, e.wall_ns, e.request_id, coalesce(e.tenant_id, "
        f"(SELECT max(r.tenant_id) FROM events_requests r WHERE r.request_id = e.request_id)) "
        f"FROM events e JOIN (VALUES {values}) k(p, s) ON e.producer_id = k.p AND e.seq = k.s"
    ).fetchall()
    runs = con.execute(
        f"SELECT r.producer_id, r.seq, r.page_start, r.num_pages FROM page_runs r "
        f"JOIN (VALUES {values}) k(p, s) ON r.producer_id = k.p AND r.seq = k.s ORDER BY r.list, r.pos"
    ).fetchall()
    pages: dict[tuple[int, int], list[int]] = {}
    for p, s, start, n in runs:
        pages.setdefault((int(p), int(s)), []).extend(range(int(start), int(start) + int(n)))
    return {
        (int(p), int(s)): {
            "producer_id": int(p),
            "seq": int(s),
            "batch_no": int(b),
            "kind": kind,
            "wall_ns": int(w),
            "request_id": rid,
            "tenant_id": tid,
            "pages": sorted(set(pages.get((int(p), int(s)), []))),
        }
        for p, s, b, kind, w, rid, tid in rows
    }


def write_notices(
    out: Path, findings: pl.DataFrame, affected: pl.DataFrame, texts: dict[str, str], db: str | Path, signer: Signer
) -> list[str]:
    """Write ``out/notices/<tenant>/`` for each tenant with affected responses; returns the files written
    (relative to ``out``). ``texts``: each tenant's notice text; ``db``: the store (read-only)."""
    from kvtrail.audit.store import connect_readonly

    con = connect_readonly(db)
    try:
        view = LogView(con)
        cp = view.checkpoint()
        note = sign_checkpoint(cp, signer).text()
        f = findings.filter(pl.col("code").is_in(sorted(AFFECTED_CODES)))
        by_request: dict[str, list[dict]] = {}
        for row in f.iter_rows(named=True):
            by_request.setdefault(row["request_id"], []).append(row)
        keys = {(int(e["producer_id"]), int(e["seq"])) for row in f.iter_rows(named=True) for e in row["evidence"]}
        events = _evidence_events(con, keys)
        written = []
        recipient = dict(zip(affected["request_id"], affected["tenant_id"]))
        received: dict[str, list[dict]] = {}
        for row in affected.sort("last_ns").iter_rows(named=True):
            if row["tenant_id"] is None:
                continue
            rows = by_request.get(row["request_id"], [])
            received.setdefault(row["tenant_id"], []).append(
                {
                    "role": "recipient",
                    "request_id": row["request_id"],
                    "time_ns": row["last_ns"],
                    "pages": sorted({int(p) for r in rows for p in (r["pages"] or [])}),
                    "codes": sorted(set(row["codes"] or [])),
                    "other_tenants_data": any(
                        v not in (None, row["tenant_id"], NEVER_WRITTEN, UNKNOWN_TENANT)
                        for v in row["victim_tenants"] or []
                    ),
                    "evidence": [
                        list(k)
                        for k in sorted({(int(e["producer_id"]), int(e["seq"])) for r in rows for e in r["evidence"]})
                    ],
                }
            )
        # A tenant whose data another tenant's response read: each such finding, the reader as hashes.
        for row in f.sort("last_ns").iter_rows(named=True):
            reader = recipient.get(row["request_id"])
            for victim in sorted({v for v in row["victim_tenant_ids"] or [] if v not in (None, reader)}):
                if victim in (NEVER_WRITTEN, UNKNOWN_TENANT):
                    continue
                received.setdefault(victim, []).append(
                    {
                        "role": "victim",
                        "request_id": hashed(row["request_id"]),
                        "time_ns": row["last_ns"],
                        "pages": sorted(int(p) for p in row["pages"] or []),
                        "codes": [row["code"]],
                        "your_requests": sorted(
                            {
                                r
                                for r, t in zip(row["victim_request_ids"] or [], row["victim_tenant_ids"] or [])
                                if t == victim
                            }
                        ),
                        "evidence": [
                            list(k) for k in sorted({(int(e["producer_id"]), int(e["seq"])) for e in row["evidence"]})
                        ],
                    }
                )
        for tenant, responses in received.items():
            used = {tuple(k) for r in responses for k in r["evidence"]}
            shown = []
            for k in sorted(used):
                e = dict(events[k])
                if e["tenant_id"] != tenant:  # another tenant's (or nobody's) ids: hashes only
                    e["request_id"], e["tenant_id"] = hashed(e["request_id"]), hashed(e["tenant_id"])
                shown.append(e)
            proofs = view.inclusion(sorted({(e["producer_id"], e["batch_no"]) for e in shown}), cp.size)
            d = out / "notices" / folder_name(tenant)
            d.mkdir(parents=True, exist_ok=True)
            contents = {
                "notice.md": texts.get(tenant, ""),
                "responses.json": json.dumps({"tenant_id": tenant, "responses": responses}, indent=1) + "\n",
                "events.json": json.dumps(shown, indent=1) + "\n",
                "checkpoint.txt": note,
                "proofs.json": json.dumps(proofs, indent=1) + "\n",
            }
            for name, text in contents.items():
                (d / name).write_text(text, encoding="utf-8")
            manifest = {
                "tenant_id": tenant,
                "log": {"origin": cp.origin, "tree_size": cp.size},
                "files": {n: hashlib.sha256(t.encode()).hexdigest() for n, t in contents.items()},
            }
            data = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
            (d / MANIFEST).write_bytes(data)
            (d / SIGNATURE).write_text(base64.b64encode(signer.sign(data)).decode() + "\n", encoding="ascii")
            rel = d.relative_to(out)
            written += [str(rel / n) for n in (*FILES, MANIFEST, SIGNATURE)]
        return written
    finally:
        con.close()


def _load(d: Path, name: str) -> bytes:
    try:
        return (d / name).read_bytes()
    except OSError as exc:
        raise KvtrailError(f"{d / name}: cannot read ({exc.strerror or exc})") from None


def verify_notice(folder: str | Path, checker: SignatureChecker) -> list[str]:
    """Problems of a notice folder (none: it proves itself), with nothing but the folder and the key."""
    d = Path(folder)
    if not d.is_dir():
        raise KvtrailError(f"DIR: {d} is not a folder")
    data = _load(d, MANIFEST)
    try:
        sig = base64.b64decode(_load(d, SIGNATURE).strip(), validate=True)
    except ValueError:
        sig = b""
    if not checker.check(data, sig):
        return [f"{MANIFEST}: its signature does not verify with the given public key"]
    manifest = json.loads(data)
    problems = []
    raw = {}
    for name in FILES:
        raw[name] = _load(d, name)
        if hashlib.sha256(raw[name]).hexdigest() != manifest["files"].get(name):
            problems.append(f"{name}: edited (its SHA-256 is not the signed one)")
    if problems:
        return problems
    note = parse_note(raw["checkpoint.txt"], "checkpoint.txt")
    if not verify_log_signature(note, checker):
        problems.append("checkpoint.txt: not signed by the given key")
    cp = note.checkpoint
    proofs = json.loads(raw["proofs.json"])
    problems += [f"proofs.json: {p}" for p in check_inclusion_doc(proofs, cp)]
    proven = {(leaf["producer_id"], leaf["batch_no"]) for leaf in proofs.get("leaves", [])}
    events = {(e["producer_id"], e["seq"]): e for e in json.loads(raw["events.json"])}
    for e in events.values():
        if (e["producer_id"], e["batch_no"]) not in proven:
            problems.append(f"event {e['producer_id']}.{e['seq']}: its batch has no inclusion proof")
    doc = json.loads(raw["responses.json"])
    own = doc["tenant_id"]
    for r in doc["responses"]:
        problems += _supports(r, own, events)
    return problems


def _supports(r: dict, tenant: str, events: dict) -> list[str]:
    """Whether an entry's listed events support its finding: for a response the tenant received, an event
    of that request on its pages (and, where another tenant's data is named, an earlier event of another
    tenant there); for a read of the tenant's data, an event of one of its requests on those pages and a
    later event of the (hashed) reader there."""
    role = r.get("role", "recipient")
    where = f"{'response' if role == 'recipient' else 'read by'} {r['request_id']}"
    evs = []
    for k in r["evidence"]:
        if tuple(k) not in events:
            return [f"{where}: evidence event {k[0]}.{k[1]} is not listed in events.json"]
        evs.append(events[tuple(k)])
    if not r["codes"]:
        return [f"{where}: no finding code"]
    pages = set(r["pages"])
    if role == "victim":
        mine = [
            e
            for e in evs
            if e["tenant_id"] == tenant and e["request_id"] in r["your_requests"] and pages & set(e["pages"])
        ]
        if not mine:
            return [f"{where}: no listed event of your requests on its pages {sorted(pages)[:8]}"]
        first = min(e["wall_ns"] for e in mine)
        if not any(
            e["request_id"] == r["request_id"] and pages & set(e["pages"]) and e["wall_ns"] >= first for e in evs
        ):
            return [f"{where}: no listed event of the reader on those pages after your request wrote them"]
        return []
    mine = [e for e in evs if e["request_id"] == r["request_id"] and pages & set(e["pages"])]
    if not mine:
        return [f"{where}: no listed event of this request on its pages {sorted(pages)[:8]}"]
    if r["other_tenants_data"]:
        read_at = max(e["wall_ns"] for e in mine)
        others = [
            e
            for e in evs
            if e["tenant_id"] not in (None, tenant, hashed(tenant))
            and pages & set(e["pages"])
            and e["wall_ns"] <= read_at
        ]
        if not others:
            return [f"{where}: no listed event of another tenant on its pages before its read"]
    return []
