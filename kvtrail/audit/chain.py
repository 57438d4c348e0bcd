"""Tamper evidence: a SHA-256 chain over each producer's committed batches, optionally signed.

A batch digest is ``SHA-256(prev_digest || header || canonical(events) || canonical(page_runs))``.
The canonical form is computed from the rows as stored (ordered by sequence number, then list and
position), so ``kvtrail audit verify`` can recompute it from the database alone: an edited, deleted,
inserted or reordered row changes the digest; a deleted batch breaks the next link.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrail.audit.events import ADDED_FIELDS
from kvtrail.errors import ChainError

GENESIS = bytes(32)
_ADDED = frozenset(ADDED_FIELDS)
assert sys.byteorder == "little", "canonical encoding assumes a little-endian host"


# Each byte value with its bits in reverse order: Arrow's validity bitmap holds the first row in a byte's
# low bit, the canonical form (numpy's packbits) in its high bit.
_REVERSED_BITS = np.array([int(f"{i:08b}"[::-1], 2) for i in range(256)], np.uint8)


def _validity_bytes(arr: pa.Array) -> bytes:
    """``np.packbits`` of the column's validity, read from Arrow's bitmap in place where it starts on a byte."""
    n = len(arr)
    bitmap = arr.buffers()[0]
    if bitmap is None or arr.offset % 8:
        return np.packbits(pc.is_valid(arr).to_numpy(zero_copy_only=False)).tobytes()
    packed = _REVERSED_BITS[np.frombuffer(bitmap, np.uint8, count=(n + 7) // 8, offset=arr.offset // 8)]
    if n % 8:  # the bits past the last row are undefined in Arrow, zero in packbits
        packed[-1] &= (0xFF << (8 - n % 8)) & 0xFF
    return packed.tobytes()


def _null_slots_hold_data(arr: pa.Array, lengths: np.ndarray) -> bool:
    """Whether a null string or list of ``arr`` (``lengths`` from its offsets) spans values."""
    valid_total = pc.sum(pc.list_value_length(arr) if _is_list(arr.type) else pc.binary_length(arr)).as_py() or 0
    return int(valid_total) != int(lengths.sum())


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _column_bytes(h, arr: pa.Array) -> None:
    # Validity first: a tag for "all null" (most payload columns of a batch), "no null", or the bitmap.
    n, nulls = len(arr), arr.null_count
    if n and nulls == n:
        h.update(b"N")
        return
    if nulls:
        h.update(b"V" + _validity_bytes(arr))
    else:
        h.update(b"A")
    t = arr.type
    if n == 0:  # nothing but the tag; a list column still tags its (empty) values
        if _is_list(t):
            _column_bytes(h, pa.array([], t.value_type))
        return
    # The canonical bytes are those of the column with nulls filled (0, "", an empty list); the fast paths
    # read Arrow's buffers in place and produce the same bytes without the filled copy.
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
        if not _offsets_bytes(h, arr, nulls > 0, pa.types.is_large_string(t) or pa.types.is_large_binary(t)):
            _filled_bytes(h, arr)
    elif _is_list(t):
        offsets = _offsets(arr, pa.types.is_large_list(t))
        lengths = np.diff(offsets).astype(np.int64)
        if nulls and _null_slots_hold_data(arr, lengths):  # a null list over values: flatten drops them
            h.update(pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False).astype(np.int64))
            _column_bytes(h, pc.list_flatten(arr))
            return
        h.update(lengths)
        _column_bytes(h, arr.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0])))
    elif pa.types.is_boolean(t):
        h.update(pc.fill_null(arr, False).to_numpy(zero_copy_only=False).astype(np.uint8).tobytes())
    else:
        dtype = np.dtype(t.to_pandas_dtype())
        if nulls:  # the nulls filled with 0 in one Arrow pass
            arr = pc.fill_null(arr, pa.scalar(0, t))
        h.update(np.frombuffer(arr.buffers()[1], dtype=dtype)[arr.offset : arr.offset + n])


def _offsets(arr: pa.Array, large: bool) -> np.ndarray:
    """The offsets of a string, binary or list array (one more than its length), read in place."""
    return np.frombuffer(arr.buffers()[1], dtype=np.int64 if large else np.int32)[
        arr.offset : arr.offset + len(arr) + 1
    ]


def _offsets_bytes(h, arr: pa.Array, has_nulls: bool, large: bool) -> bool:
    """Lengths (int64) and values of a string column in place; False if a null slot holds bytes."""
    offsets = _offsets(arr, large)
    lengths = np.diff(offsets).astype(np.int64)
    if has_nulls and _null_slots_hold_data(arr, lengths):
        return False
    h.update(lengths)
    data = arr.buffers()[2]
    if data is not None and len(arr):
        h.update(memoryview(data)[int(offsets[0]) : int(offsets[-1])])
    return True


def _filled_bytes(h, arr: pa.Array) -> None:
    filled = pc.fill_null(arr, "" if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type) else b"")
    _offsets_bytes(h, filled.cast(pa.large_binary()), False, True)


def table_digest(h, table: pa.Table, schema: pa.Schema, added: frozenset[str] = frozenset()) -> None:
    """Feed ``table`` into hash ``h`` in canonical form: columns of ``schema`` in its order and types.

    A column named in ``added`` (a field added after the first store format) that is null throughout
    is left out, as if the schema did not have it: batches written before it existed keep their digest.
    """
    h.update(struct.pack("<q", table.num_rows))
    for f in schema:
        if f.name in added and (f.name not in table.column_names or table.column(f.name).null_count == len(table)):
            continue
        col = table.column(f.name)
        if col.type != f.type:
            col = col.cast(f.type)
        col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        h.update(f.name.encode() + b"\0")
        _column_bytes(h, col)


def batch_digest(
    prev: bytes,
    header: tuple[int, ...],
    events: pa.Table,
    events_schema: pa.Schema,
    runs: pa.Table,
    runs_schema: pa.Schema,
) -> bytes:
    h = hashlib.sha256()
    h.update(prev)
    h.update(struct.pack(f"<{len(header)}q", *header))
    table_digest(h, events, events_schema, _ADDED)
    table_digest(h, runs, runs_schema)
    return h.digest()


def _ed25519():
    """The parts of ``cryptography`` signatures use (a base dependency); ChainError, one line, where an
    install lacks it, rather than an ImportError out of a command."""
    try:
        from cryptography import exceptions
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as exc:
        raise ChainError(
            f"signatures need the 'cryptography' package, which this install lacks ({exc}): pip install cryptography"
        ) from None
    return serialization, ed25519, exceptions


class Signer:
    """Signs batch digests with an Ed25519 private key the operator supplies (PEM, PKCS#8)."""

    def __init__(self, private_key_pem: bytes):
        serialization, ed25519, exceptions = _ed25519()
        try:
            key = serialization.load_pem_private_key(private_key_pem, password=None)
        except (ValueError, TypeError, exceptions.UnsupportedAlgorithm) as exc:
            raise ChainError(f"signing key: not a PEM private key without password ({_first_line(exc)})") from None
        if not isinstance(key, ed25519.Ed25519PrivateKey):
            raise ChainError(f"signing key: an Ed25519 key is required, got {type(key).__name__}")
        self._key = key
        pub = self._key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.raw_public = pub  # the 32-byte public key (signed notes name keys by it)
        self.key_id = hashlib.sha256(pub).hexdigest()[:16]

    @classmethod
    def from_file(cls, path: str | Path) -> "Signer":
        try:
            return cls(Path(path).read_bytes())
        except FileNotFoundError:
            raise ChainError(f"signing key: file not found: {path}") from None
        except OSError as exc:
            raise ChainError(f"signing key: cannot read {path}: {exc.strerror or exc}") from None

    def sign(self, digest: bytes) -> bytes:
        return self._key.sign(digest)


class SignatureChecker:
    """Checks signatures with the matching Ed25519 public key (PEM)."""

    def __init__(self, public_key_pem: bytes):
        serialization, ed25519, exceptions = _ed25519()
        try:
            key = serialization.load_pem_public_key(public_key_pem)
        except (ValueError, TypeError, exceptions.UnsupportedAlgorithm) as exc:
            raise ChainError(f"public key: not a PEM public key ({_first_line(exc)})") from None
        if not isinstance(key, ed25519.Ed25519PublicKey):
            raise ChainError(f"public key: an Ed25519 key is required, got {type(key).__name__}")
        self._key = key
        pub = self._key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.raw_public = pub
        self.key_id = hashlib.sha256(pub).hexdigest()[:16]
        self._invalid = exceptions.InvalidSignature

    @classmethod
    def from_file(cls, path: str | Path) -> "SignatureChecker":
        try:
            return cls(Path(path).read_bytes())
        except FileNotFoundError:
            raise ChainError(f"public key: file not found: {path}") from None
        except OSError as exc:
            raise ChainError(f"public key: cannot read {path}: {exc.strerror or exc}") from None

    def check(self, digest: bytes, signature: bytes | None) -> bool:
        if signature is None:
            return False
        try:
            self._key.verify(signature, digest)
            return True
        except self._invalid:
            return False


def _first_line(exc: BaseException) -> str:
    """An exception's message on one line (cryptography's parse errors span several)."""
    return " ".join(str(exc).split())


def generate_keypair(private_path: Path, public_path: Path) -> str:
    """Write a new Ed25519 key pair as PEM files; returns the key id."""
    serialization, ed25519, _ = _ed25519()
    key = ed25519.Ed25519PrivateKey.generate()
    private_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    private_path.chmod(0o600)
    public_path.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return Signer(private_path.read_bytes()).key_id
