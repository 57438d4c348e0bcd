"""The file a lake's page-state checkpoint is written in (from checkpoint format 3): a JSON header and named
numpy arrays, each compressed on its own with zstd.

Layout: the 8 bytes :data:`MAGIC`, the header's length (4 bytes, little-endian), the header (UTF-8 JSON:
``info``, the checkpoint's own description, and ``arrays``, one entry per array with its name, dtype,
shape, and its compressed bytes' offset and size after the header) and the compressed arrays back to back.
An array is decompressed into a buffer of its own that the returned array uses as it is (no copy, and
writable: a restored pool's arrays are changed in place by the replay), so reading a checkpoint costs
its decompression and little more. Checkpoints of formats 1 and 2 are ``.npz`` files (a zip archive):
:func:`is_array_file` tells the two apart by the first bytes. :func:`check` is what ``kvtrail lake verify``
runs on a checkpoint of either kind.
"""

from __future__ import annotations

import io
import json
import struct

import numpy as np
import pyarrow as pa

MAGIC = b"KVTARR1\n"
CODEC = "zstd"
LEVEL = 3  # on the fleet benchmark's checkpoints: ~8x smaller than zlib's .npz, and faster to both write and read
_LEN = struct.Struct("<I")
_ZIP = b"PK\x03\x04"  # an .npz: a zip archive


def is_array_file(data: bytes) -> bool:
    return data[: len(MAGIC)] == MAGIC


def pack(info: dict, arrays: dict[str, np.ndarray]) -> bytes:
    """The file of ``info`` (JSON-able) and ``arrays`` (names unique; any numeric or bool dtype)."""
    codec = pa.Codec(CODEC, compression_level=LEVEL)
    entries, blobs, offset = [], [], 0
    for name, arr in arrays.items():
        a = np.ascontiguousarray(arr)
        dtype = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
        a = a.astype(dtype, copy=False)
        blob = codec.compress(a.reshape(-1).view(np.uint8), asbytes=True) if a.nbytes else b""
        entries.append({"name": name, "dtype": dtype.str, "shape": list(a.shape), "offset": offset, "size": len(blob)})
        blobs.append(blob)
        offset += len(blob)
    header = json.dumps({"info": info, "codec": CODEC, "arrays": entries}).encode()
    return b"".join([MAGIC, _LEN.pack(len(header)), header, *blobs])


def _header(data: bytes) -> tuple[dict, int]:
    """(the header, where the arrays start); ValueError naming what is wrong."""
    if not is_array_file(data):
        raise ValueError("not a kvtrail array file (bad magic)")
    start = len(MAGIC) + _LEN.size
    if len(data) < start:
        raise ValueError("truncated header")
    (n,) = _LEN.unpack_from(data, len(MAGIC))
    if len(data) < start + n:
        raise ValueError("truncated header")
    try:
        head = json.loads(data[start : start + n].decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"header is not JSON ({exc})") from None
    if not isinstance(head, dict) or not isinstance(head.get("info"), dict) or not isinstance(head.get("arrays"), list):
        raise ValueError("header lacks info or arrays")
    if head.get("codec") != CODEC:
        raise ValueError(f"codec {head.get('codec')!r}, expected {CODEC!r}")
    return head, start + n


def read_info(data: bytes) -> dict:
    """The file's ``info`` (the arrays are not read)."""
    return _header(data)[0]["info"]


def unpack(data: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """(info, arrays) of a file :func:`pack` wrote; ValueError naming what does not fit."""
    head, base = _header(data)
    codec = pa.Codec(CODEC)
    view = memoryview(data)
    out: dict[str, np.ndarray] = {}
    for e in head["arrays"]:
        try:
            name, dtype, shape = e["name"], np.dtype(e["dtype"]), tuple(int(s) for s in e["shape"])
            lo, size = base + int(e["offset"]), int(e["size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"array entry {e!r}: {exc}") from None
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if lo < base or lo + size > len(data) or (size == 0) != (nbytes == 0):
            raise ValueError(f"array {name}: its bytes lie outside the file")
        if not nbytes:
            out[name] = np.zeros(shape, dtype)
            continue
        try:
            buf = codec.decompress(view[lo : lo + size], decompressed_size=nbytes)
        except (OSError, pa.ArrowException) as exc:
            raise ValueError(f"array {name}: does not decompress ({exc})") from None
        out[name] = np.frombuffer(buf, dtype).reshape(shape)  # the decompressed buffer is the array's own
    return head["info"], out


def check(data: bytes) -> tuple[dict | None, str | None]:
    """(info, None) when a checkpoint file reads whole (this format, or an ``.npz`` of formats 1 and 2),
    else (None, what is wrong)."""
    try:
        if not data.startswith(_ZIP):
            info, _ = unpack(data)
            return info, None
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            arrays = {name: z[name] for name in z.files}  # every member inflates
        return json.loads(bytes(arrays["info"]).decode()), None
    except Exception as exc:  # any unreadable file is one problem line, never a traceback
        return None, f"{type(exc).__name__}: {exc}"
