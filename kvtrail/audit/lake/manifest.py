"""The lake manifest: one per export, each listing every live file of the lake, signed when a key is given.

``manifests/manifest-NNNNNN.json`` (the highest number is current) holds the producers' chain heads,
per file its SHA-256, rows, partition and the batch range of each producer it holds, the last exported
batch per producer (what makes the next export incremental) and the SHA-256 of the manifest before it,
so the export history is a chain too, and the store's transparency log it covers (``tree_origin``,
``tree_size``, base64 ``tree_root``: kvtrail.audit.tlog). ``signature`` signs the SHA-256 of the
manifest's canonical JSON without that field (:class:`kvtrail.audit.chain.Signer`, Ed25519).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from kvtrail.audit.chain import SignatureChecker, Signer
from kvtrail.audit.lake.fs import LakeFS
from kvtrail.errors import KvtrailError

FORMAT = "kvtrail-lake"
FORMAT_VERSION = 1
MANIFEST_DIR = "manifests"


def manifest_name(number: int) -> str:
    return f"{MANIFEST_DIR}/manifest-{number:06d}.json"


def canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def body_digest(doc: dict) -> bytes:
    """SHA-256 of the manifest without its signature: what the signature signs."""
    return hashlib.sha256(canonical({k: v for k, v in doc.items() if k != "signature"})).digest()


@dataclass
class LakeManifest:
    """The current state of a lake (``doc`` is the JSON object), with the bytes it was read from."""

    number: int = 0
    doc: dict = field(default_factory=dict)
    raw: bytes = b""

    @property
    def files(self) -> dict[str, dict]:
        return self.doc.get("files", {})

    @property
    def exported(self) -> dict[str, int]:
        """Last exported batch_no per producer id (as a string)."""
        return self.doc.get("exported_batches", {})

    @property
    def tree(self) -> tuple[str, int, str] | None:
        """(origin, size, base64 root) of the store's log as of this export; None before the log existed."""
        d = self.doc
        return (d["tree_origin"], d["tree_size"], d["tree_root"]) if "tree_size" in d else None

    def files_of(self, table: str) -> dict[str, dict]:
        return {p: f for p, f in self.files.items() if f["table"] == table}

    def next_doc(self) -> dict:
        """The next manifest's starting point: this one's files and state, linked to this one."""
        prev = hashlib.sha256(self.raw).hexdigest() if self.raw else None
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "export_no": self.number + 1,
            "prev_manifest_sha256": prev,
            "files": dict(self.files),
            "exported_batches": dict(self.exported),
            "chain_heads": dict(self.doc.get("chain_heads", {})),
            "producers": dict(self.doc.get("producers", {})),
        }


def manifest_numbers(lake: LakeFS) -> list[int]:
    out = []
    for rel in lake.list(MANIFEST_DIR):
        name = rel.rsplit("/", 1)[-1]
        if name.startswith("manifest-") and name.endswith(".json") and name[9:-5].isdigit():
            out.append(int(name[9:-5]))
    return sorted(out)


def parse_manifest(raw: bytes, where: str) -> dict:
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KvtrailError(f"{where}: unreadable manifest ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
        raise KvtrailError(f"{where}: not a {FORMAT} manifest of format_version {FORMAT_VERSION}")
    for key, kind in (("files", dict), ("exported_batches", dict), ("chain_heads", dict), ("producers", dict)):
        if not isinstance(doc.get(key), kind):
            raise KvtrailError(f"{where}: field {key!r} missing or not an object")
    # The store's transparency log the export covers (absent in manifests written before the log).
    if "tree_size" in doc and not (
        isinstance(doc["tree_size"], int)
        and isinstance(doc.get("tree_root"), str)
        and isinstance(doc.get("tree_origin"), str)
    ):
        raise KvtrailError(f"{where}: fields 'tree_size', 'tree_root', 'tree_origin': an integer and two strings")
    return doc


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


def write_manifest(lake: LakeFS, doc: dict, signer: Signer | None) -> bytes:
    if signer is not None:
        doc["signature"] = {"key_id": signer.key_id, "ed25519": signer.sign(body_digest(doc)).hex()}
    raw = json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n"
    lake.write(manifest_name(doc["export_no"]), raw)
    return raw


def check_signature(doc: dict, checker: SignatureChecker) -> str | None:
    """None when the manifest carries a valid signature, else what is wrong."""
    sig = doc.get("signature")
    if not isinstance(sig, dict) or not isinstance(sig.get("ed25519"), str):
        return "the manifest is not signed"
    try:
        ok = checker.check(body_digest(doc), bytes.fromhex(sig["ed25519"]))
    except ValueError:
        ok = False
    return None if ok else "the manifest's signature does not verify"
