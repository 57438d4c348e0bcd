"""The manifest of every Parquet export (``kvtrail lake export`` and ``kvtrail audit export``): one typed definition.

``manifests/manifest-NNNNNN.json`` (the highest number is current) holds the producers' chain heads,
per file its SHA-256, rows, partition and the batch range of each producer it holds, the last exported
batch per producer (what makes the next export incremental) and the SHA-256 of the manifest before it,
so the export history is a chain too. ``signature`` signs the SHA-256 of the manifest's canonical JSON
without that field (:class:`kvtrail.audit.chain.Signer`, Ed25519).

:class:`Manifest` is the format: its fields are the JSON's keys, and reading, checking and writing
follow them, so a new field is one line here (with a default, so older manifests still read).
Format 1 (lakes before the two exports shared one format) is read as is: format 2 only adds
``store_format`` and files of the store's other tables (``meta``, ``prunes``, ``prune_batches``,
``legal_holds``), which a whole-store export (``kvtrail audit export``) writes.
The store's transparency log the export covers is ``tree_origin``, ``tree_size`` and base64
``tree_root`` (kvtrail.audit.tlog; absent in manifests written before the log).
"""

from __future__ import annotations

import hashlib
import json
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from kvtrail.audit.chain import SignatureChecker, Signer
from kvtrail.audit.lake.fs import LakeFS
from kvtrail.errors import KvtrailError

FORMAT = "kvtrail-lake"
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)
MANIFEST_DIR = "manifests"
_REQUIRED = {"required": True}  # a key every manifest has, even one whose value is empty
_OMIT = {"omit_empty": True}  # a key written only when it holds something
PARTITIONED = ("events", "page_runs", "checkpoint")  # tables whose files lie in a partition's folder


@dataclass(frozen=True)
class FileEntry:
    """One file of the lake: its table (or ``checkpoint``), SHA-256, size, rows and the export that wrote
    it; event, page-run and checkpoint files also name their partition, event and page-run files the
    producer and its batch range ``[first, last]``."""

    table: str
    sha256: str
    bytes: int
    rows: int
    export_no: int
    cluster: str | None = field(default=None, metadata=_OMIT)
    node: str | None = field(default=None, metadata=_OMIT)
    hour: int | None = field(default=None, metadata=_OMIT)
    producer_id: int | None = field(default=None, metadata=_OMIT)
    batches: list[int] | None = field(default=None, metadata=_OMIT)

    def __post_init__(self) -> None:
        if self.table in PARTITIONED and (self.cluster is None or self.node is None or self.hour is None):
            raise ValueError(f"a {self.table} file must name its partition (cluster, node, hour)")

    @property
    def part(self) -> tuple[tuple[str, str], int]:
        """((cluster, node), hour) of a partition's file."""
        assert self.cluster is not None and self.node is not None and self.hour is not None, self.table
        return (self.cluster, self.node), self.hour


@dataclass
class Manifest:
    """One manifest (see the module doc). An export builds the next one from the current one
    (:meth:`LakeManifest.next`) and fills it in as it writes files."""

    export_no: int
    files: dict[str, FileEntry] = field(default_factory=dict, metadata=_REQUIRED)
    exported_batches: dict[str, int] = field(default_factory=dict, metadata=_REQUIRED)  # producer id -> batch_no
    chain_heads: dict[str, dict] = field(default_factory=dict, metadata=_REQUIRED)  # id -> {batch_no, digest}
    producers: dict[str, dict] = field(default_factory=dict, metadata=_REQUIRED)  # id -> identity fields
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    prev_manifest_sha256: str | None = None
    kvtrail_version: str | None = None
    exported_at: str | None = None
    store_format: str | None = field(default=None, metadata=_OMIT)  # of the store a whole-store export read
    tree_origin: str | None = field(default=None, metadata=_OMIT)  # the store's transparency log (audit.tlog)
    tree_size: int | None = field(default=None, metadata=_OMIT)  # batches it covers as of this export
    tree_root: str | None = field(default=None, metadata=_OMIT)  # its root hash, base64
    # producer id -> {batch_no, prev_digest}: where a chain exported from a later batch (--since) starts
    anchors: dict[str, dict] = field(default_factory=dict, metadata=_OMIT)
    signature: dict | None = field(default=None, metadata=_OMIT)  # {key_id, ed25519}

    def files_of(self, table: str) -> dict[str, FileEntry]:
        return {p: f for p, f in self.files.items() if f.table == table}

    def to_json(self) -> dict:
        return _to_json(self)


def _to_json(obj: Any) -> dict:
    out: dict = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get("omit_empty") and (value is None or value == {}):  # hour 0 and producer 0 are values
            continue
        if isinstance(value, dict):
            value = {k: _to_json(v) if isinstance(v, FileEntry) else v for k, v in value.items()}
        out[f.name] = value
    return out


def _kinds(hint: Any) -> tuple[type, ...]:
    """The JSON value types a field's annotation allows (``str | None`` -> (str, NoneType))."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(k for h in typing.get_args(hint) for k in _kinds(h))
    return (typing.get_origin(hint) or hint,)


def _from_json(cls: type, doc: Any, where: str) -> Any:
    if not isinstance(doc, dict):
        raise KvtrailError(f"{where}: not an object")
    hints = typing.get_type_hints(cls)
    values = {}
    for f in fields(cls):
        if f.name not in doc:
            if f.metadata.get("required") or (f.default is MISSING and f.default_factory is MISSING):
                raise KvtrailError(f"{where}: field {f.name!r} missing")
            continue
        value, kinds = doc[f.name], _kinds(hints[f.name])
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise KvtrailError(f"{where}: field {f.name!r} must be {names}, not {type(value).__name__}")
        if f.name == "files" and isinstance(value, dict):
            value = {p: _from_json(FileEntry, e, f"{where}: file {p}") for p, e in value.items()}
        values[f.name] = value
    try:
        return cls(**values)
    except ValueError as exc:
        raise KvtrailError(f"{where}: {exc}") from None


def canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def body_digest(doc: dict) -> bytes:
    """SHA-256 of the manifest without its signature: what the signature signs."""
    return hashlib.sha256(canonical({k: v for k, v in doc.items() if k != "signature"})).digest()


def manifest_name(number: int) -> str:
    return f"{MANIFEST_DIR}/manifest-{number:06d}.json"


@dataclass
class LakeManifest:
    """The current state of a lake (``doc``), with its number and the bytes it was read from
    (number 0: a lake with no manifest yet)."""

    number: int = 0
    doc: Manifest = field(default_factory=lambda: Manifest(export_no=0))
    raw: bytes = b""

    @property
    def files(self) -> dict[str, FileEntry]:
        return self.doc.files

    def files_of(self, table: str) -> dict[str, FileEntry]:
        return self.doc.files_of(table)

    @property
    def tree(self) -> tuple[str, int, str] | None:
        """(origin, size, base64 root) of the store's log as of this export; None before the log existed."""
        d = self.doc
        if d.tree_size is None or d.tree_origin is None or d.tree_root is None:
            return None
        return d.tree_origin, d.tree_size, d.tree_root

    def next(self) -> Manifest:
        """The next manifest's starting point: this one's files and state, linked to this one."""
        d = self.doc
        return Manifest(
            export_no=self.number + 1,
            prev_manifest_sha256=hashlib.sha256(self.raw).hexdigest() if self.raw else None,
            files=dict(d.files),
            exported_batches=dict(d.exported_batches),
            chain_heads=dict(d.chain_heads),
            producers=dict(d.producers),
            anchors=dict(d.anchors),
        )


def manifest_numbers(lake: LakeFS) -> list[int]:
    out = []
    for rel in lake.list(MANIFEST_DIR):
        name = rel.rsplit("/", 1)[-1]
        if name.startswith("manifest-") and name.endswith(".json") and name[9:-5].isdigit():
            out.append(int(name[9:-5]))
    return sorted(out)


def parse_manifest(raw: bytes, where: str) -> Manifest:
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KvtrailError(f"{where}: unreadable manifest ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("format_version") not in READ_VERSIONS:
        raise KvtrailError(f"{where}: not a {FORMAT} manifest of format_version {' or '.join(map(str, READ_VERSIONS))}")
    m = _from_json(Manifest, doc, where)
    tree = (m.tree_origin, m.tree_size, m.tree_root)
    if any(v is not None for v in tree) and any(v is None for v in tree):
        raise KvtrailError(f"{where}: fields 'tree_size', 'tree_root', 'tree_origin': all three or none")
    return m


def read_manifest(lake: LakeFS, number: int | None = None) -> LakeManifest:
    """The lake's current manifest (or ``number``); an empty one for a lake with none yet."""
    numbers = manifest_numbers(lake)
    if number is None:
        if not numbers:
            return LakeManifest()
        number = numbers[-1]
    raw = lake.read(manifest_name(number))
    return LakeManifest(number, parse_manifest(raw, f"{lake.url}/{manifest_name(number)}"), raw)


def require_manifest(lake: LakeFS) -> LakeManifest:
    m = read_manifest(lake)
    if not m.number:
        raise KvtrailError(f"--lake: {lake.url} holds no lake manifest (run kvtrail lake export first)")
    return m


def write_manifest(lake: LakeFS, doc: Manifest, signer: Signer | None) -> bytes:
    body = doc.to_json()
    if signer is not None:
        body["signature"] = {"key_id": signer.key_id, "ed25519": signer.sign(body_digest(body)).hex()}
    raw = json.dumps(body, indent=1, sort_keys=True).encode() + b"\n"
    lake.write(manifest_name(doc.export_no), raw)
    return raw


def check_signature(m: LakeManifest, checker: SignatureChecker) -> str | None:
    """None when the manifest carries a valid signature, else what is wrong. The signature is checked
    against the bytes read, so keys this kvtrail does not know are signed too."""
    doc = json.loads(m.raw)
    sig = doc.get("signature")
    if not isinstance(sig, dict) or not isinstance(sig.get("ed25519"), str):
        return "the manifest is not signed"
    try:
        ok = checker.check(body_digest(doc), bytes.fromhex(sig["ed25519"]))
    except ValueError:
        ok = False
    return None if ok else "the manifest's signature does not verify"
