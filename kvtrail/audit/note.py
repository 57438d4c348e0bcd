"""C2SP signed notes, checkpoints and cosignatures (c2sp.org/signed-note, tlog-checkpoint, tlog-cosignature).

A checkpoint is the note body ``<origin>\\n<tree size>\\n<base64 root>\\n`` plus optional extension
lines; a blank line; then one signature line per signer, ``— <key name> <base64(key id ‖ signature)>``.
An Ed25519 log signature (type 0x01) signs the body; its key id is
``SHA-256(name ‖ "\\n" ‖ 0x01 ‖ public key)[:4]``. A witness cosignature (cosignature/v1, type 0x04)
signs ``cosignature/v1\\ntime <t>\\n`` followed by the body, and carries ``key id ‖ u64 t ‖ signature``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import struct
import time
from dataclasses import dataclass

from kvtrail.audit.chain import SignatureChecker, Signer
from kvtrail.audit.merkle import HASH_SIZE
from kvtrail.errors import ChainError, KvtrailError

DASH = "\u2014"  # the em dash that starts a signature line
ED25519 = 0x01
COSIGNATURE_V1 = 0x04
_NAME = re.compile(r"^[^\s+]+$")
MAX_NOTE_BYTES = 1_000_000


def raw_public_key(pub: Signer | SignatureChecker) -> bytes:
    return pub.raw_public


def key_id(name: str, pub: bytes, kind: int = ED25519) -> bytes:
    return hashlib.sha256(name.encode() + b"\n" + bytes([kind]) + pub).digest()[:4]


def vkey(name: str, pub: bytes, kind: int = ED25519) -> str:
    """The signed-note verifier key text: ``<name>+<hex key id>+<base64(type ‖ public key)>``."""
    return f"{name}+{key_id(name, pub, kind).hex()}+{base64.b64encode(bytes([kind]) + pub).decode()}"


@dataclass(frozen=True)
class Checkpoint:
    """A log's signed statement of its tree: origin, size, root (and extension lines it also signs)."""

    origin: str
    size: int
    root: bytes
    extensions: tuple[str, ...] = ()

    def body(self) -> str:
        lines = [self.origin, str(self.size), base64.b64encode(self.root).decode(), *self.extensions]
        return "".join(line + "\n" for line in lines)


@dataclass(frozen=True)
class SignatureLine:
    name: str
    blob: bytes  # key id ‖ signature

    def text(self) -> str:
        return f"{DASH} {self.name} {base64.b64encode(self.blob).decode()}\n"


@dataclass(frozen=True)
class Note:
    """A parsed signed note: the checkpoint its body states and its signature lines (none checked yet)."""

    checkpoint: Checkpoint
    signatures: tuple[SignatureLine, ...]

    def text(self) -> str:
        return self.checkpoint.body() + "\n" + "".join(s.text() for s in self.signatures)

    def with_signatures(self, extra: list[SignatureLine]) -> Note:
        have = set(self.signatures)
        return Note(self.checkpoint, self.signatures + tuple(s for s in extra if s not in have))


def check_name(name: str, what: str = "key name") -> str:
    if not name or not _NAME.match(name):
        raise KvtrailError(f"{what}: {name!r} must be non-empty, without spaces or '+'")
    return name


def sign_checkpoint(cp: Checkpoint, signer: Signer, name: str | None = None) -> Note:
    """The checkpoint signed by the log's key, under ``name`` (the origin by default)."""
    name = check_name(name or cp.origin)
    sig = signer.sign(cp.body().encode())
    return Note(cp, (SignatureLine(name, key_id(name, raw_public_key(signer)) + sig),))


def cosign(cp: Checkpoint, signer: Signer, name: str, now: int | None = None) -> SignatureLine:
    """A witness's cosignature/v1 line on ``cp`` at ``now`` (POSIX seconds)."""
    check_name(name, "witness name")
    t = int(time.time()) if now is None else now
    sig = signer.sign(_cosigned_message(cp, t))
    return SignatureLine(name, key_id(name, raw_public_key(signer), COSIGNATURE_V1) + struct.pack(">Q", t) + sig)


def _cosigned_message(cp: Checkpoint, t: int) -> bytes:
    return f"cosignature/v1\ntime {t}\n".encode() + cp.body().encode()


def parse_note(text: str | bytes, source: str = "checkpoint") -> Note:
    """Parse a checkpoint note; KvtrailError naming ``source`` and what is wrong (nothing verified yet)."""
    if isinstance(text, bytes):
        if len(text) > MAX_NOTE_BYTES:
            raise KvtrailError(f"{source}: larger than {MAX_NOTE_BYTES} bytes")
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise KvtrailError(f"{source}: not UTF-8 text") from None
    body, sep, sigs = text.partition("\n\n")
    if not sep:
        raise KvtrailError(f"{source}: no blank line between the checkpoint and its signatures")
    lines = body.split("\n")
    if len(lines) < 3:
        raise KvtrailError(f"{source}: a checkpoint needs an origin, a tree size and a root hash line")
    origin, size_text, root_text, *ext = lines
    if not origin:
        raise KvtrailError(f"{source}: empty origin line")
    if not re.fullmatch(r"0|[1-9][0-9]{0,18}", size_text):
        raise KvtrailError(f"{source}: tree size {size_text!r} is not a decimal without leading zeros")
    try:
        root = base64.b64decode(root_text, validate=True)
    except binascii.Error:
        root = b""
    if len(root) != HASH_SIZE:
        raise KvtrailError(f"{source}: root hash {root_text!r} is not base64 of {HASH_SIZE} bytes")
    if any(not e for e in ext):
        raise KvtrailError(f"{source}: empty extension line")
    if not sigs.endswith("\n"):
        raise KvtrailError(f"{source}: the last signature line does not end in a newline")
    parsed = []
    for i, line in enumerate(sigs[:-1].split("\n"), 1):
        parts = line.split(" ")
        if len(parts) != 3 or parts[0] != DASH:
            raise KvtrailError(f"{source}: signature line {i} is not '{DASH} <name> <base64>'")
        try:
            blob = base64.b64decode(parts[2], validate=True)
        except binascii.Error:
            raise KvtrailError(f"{source}: signature line {i}: not base64") from None
        if len(blob) < 5:
            raise KvtrailError(f"{source}: signature line {i}: too short")
        parsed.append(SignatureLine(check_name(parts[1], f"{source}: signature line {i}"), blob))
    if not parsed:
        raise KvtrailError(f"{source}: no signature line")
    return Note(Checkpoint(origin, int(size_text), root, tuple(ext)), tuple(parsed))


def verify_log_signature(note: Note, checker: SignatureChecker, name: str | None = None) -> bool:
    """Whether a signature line under ``name`` (the origin by default) by ``checker``'s key signs the body."""
    name = name or note.checkpoint.origin
    kid = key_id(name, raw_public_key(checker))
    body = note.checkpoint.body().encode()
    for s in note.signatures:
        if s.name == name and s.blob[:4] == kid and len(s.blob) == 4 + 64 and checker.check(body, s.blob[4:]):
            return True
    return False


def cosigners(note: Note, witness_keys: list[SignatureChecker]) -> list[tuple[str, int]]:
    """(name, time) of each trusted witness key with a valid cosignature/v1 on the note (one per key)."""
    found = []
    for checker in witness_keys:
        pub = raw_public_key(checker)
        for s in note.signatures:
            if len(s.blob) != 4 + 8 + 64 or s.blob[:4] != key_id(s.name, pub, COSIGNATURE_V1):
                continue
            (t,) = struct.unpack(">Q", s.blob[4:12])
            if t < 2**63 and checker.check(_cosigned_message(note.checkpoint, t), s.blob[12:]):
                found.append((s.name, t))
                break
    return found


def load_note(path: str, checker: SignatureChecker | None = None, what: str = "--checkpoint") -> Note:
    """A checkpoint file parsed and (with ``checker``) its log signature checked: ChainError if not signed."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_NOTE_BYTES + 1)
    except OSError as exc:
        raise KvtrailError(f"{what}: cannot read {path}: {exc.strerror or exc}") from None
    note = parse_note(data, f"{what} {path}")
    if checker is not None and not verify_log_signature(note, checker):
        raise ChainError(f"{what} {path}: no valid signature of {note.checkpoint.origin} by the given public key")
    return note
