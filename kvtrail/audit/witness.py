"""A witness (c2sp.org/tlog-witness): cosigns a log's checkpoint only if it extends the last one it cosigned.

Per log (its origin) the witness keeps the latest checkpoint it cosigned in ``<state>/logs/<hash>.json``.
The first checkpoint it sees of a log is cosigned without a proof; each later one only with a valid RFC 9162
consistency proof from the recorded one. A smaller tree (a rollback), the same size with another root, or
a proof that does not verify (a fork) is refused, never cosigned, and kept in ``<state>/refused/`` as
evidence. Checking and recording happen under one lock (a file lock across processes), so two
concurrent submissions cannot roll the record back.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvtrail.audit.chain import SignatureChecker, Signer, generate_keypair
from kvtrail.audit.merkle import verify_consistency
from kvtrail.audit.note import Note, SignatureLine, cosign, verify_log_signature
from kvtrail.errors import KvtrailError

MAX_PROOF_LINES = 63


class Refused(KvtrailError):
    """The witness will not cosign: ``status`` is the tlog-witness HTTP status (403, 404, 409, 422)."""

    def __init__(self, status: int, reason: str, recorded_size: int | None = None):
        super().__init__(reason)
        self.status = status
        self.recorded_size = recorded_size


@dataclass(frozen=True)
class Recorded:
    size: int
    root: bytes


class Witness:
    """One witness: its key and name, the log keys it trusts, its state folder."""

    def __init__(self, state_dir: str | Path, log_keys: list[SignatureChecker], signer: Signer, name: str):
        self.dir = Path(state_dir)
        self.log_keys = log_keys
        self.signer = signer
        self.name = name
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)

    @classmethod
    def open(cls, state_dir: str | Path, log_key_paths: list[str], key_path: str | None, name: str | None) -> Witness:
        """A witness from files: ``key_path`` or ``<state>/witness.pem`` (made with ``witness.pub`` on
        first use); the name defaults to ``kvtrail-witness/<key id>``."""
        d = Path(state_dir)
        if d.exists() and not d.is_dir():
            raise KvtrailError(f"--state: {d} is not a folder")
        d.mkdir(parents=True, exist_ok=True)
        if key_path is None:
            key_path = str(d / "witness.pem")
            if not Path(key_path).exists():
                generate_keypair(Path(key_path), d / "witness.pub")
        if not log_key_paths:
            raise KvtrailError("--log-key: at least one log public key is needed")
        signer = Signer.from_file(key_path)
        return cls(
            d,
            [SignatureChecker.from_file(p) for p in log_key_paths],
            signer,
            name or f"kvtrail-witness/{signer.key_id}",
        )

    def _path(self, origin: str) -> Path:
        return self.dir / "logs" / (hashlib.sha256(origin.encode()).hexdigest()[:32] + ".json")

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.dir / ".lock", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def recorded(self, origin: str) -> Recorded | None:
        p = self._path(origin)
        if not p.exists():
            return None
        doc = json.loads(p.read_text())
        return Recorded(int(doc["size"]), base64.b64decode(doc["root"]))

    def add_checkpoint(
        self, note: Note, old_size: int | None, proof: list[bytes], *, now: int | None = None
    ) -> SignatureLine:
        """Cosign ``note`` if it extends the recorded checkpoint of its log; :class:`Refused` otherwise.

        ``old_size``: the size the submitter claims the witness recorded (tlog-witness' ``old`` line); None
        takes the recorded one (the CLI, whose proof file names its own old size)."""
        cp = note.checkpoint
        if not any(verify_log_signature(note, key) for key in self.log_keys):
            raise Refused(403, f"checkpoint of {cp.origin}: no valid signature by a trusted log key")
        if len(proof) > MAX_PROOF_LINES:
            raise Refused(400, f"consistency proof: more than {MAX_PROOF_LINES} hashes")
        with self._locked():
            rec = self.recorded(cp.origin) or Recorded(0, b"")
            if old_size is not None and old_size > cp.size:
                raise Refused(400, f"old size {old_size} is larger than the checkpoint's {cp.size}")
            if old_size is not None and old_size != rec.size:
                raise Refused(409, f"old size {old_size}: the witness recorded {rec.size}", rec.size)
            if cp.size < rec.size:
                self._keep_refused(note, "rollback")
                raise Refused(409, f"rollback: tree size {cp.size} is smaller than the cosigned {rec.size}", rec.size)
            if cp.size == rec.size and rec.size and cp.root != rec.root:
                self._keep_refused(note, "fork")
                raise Refused(409, f"fork: tree size {cp.size} cosigned with another root", rec.size)
            if rec.size == 0:
                if proof:
                    raise Refused(422, "consistency proof: must be empty for a log not seen before")
            elif cp.size > rec.size and not proof:
                raise Refused(422, f"a consistency proof from the cosigned size {rec.size} is needed", rec.size)
            elif cp.size > rec.size and not verify_consistency(rec.size, cp.size, rec.root, cp.root, proof):
                self._keep_refused(note, "inconsistent")
                raise Refused(
                    422,
                    f"fork: no valid consistency proof from the cosigned size {rec.size} to {cp.size} "
                    "(the log's history differs from the one cosigned)",
                    rec.size,
                )
            line = cosign(cp, self.signer, self.name, now)
            self._record(cp.origin, cp.size, cp.root, note)
        return line

    def _record(self, origin: str, size: int, root: bytes, note: Note) -> None:
        p = self._path(origin)
        tmp = p.with_suffix(".tmp")
        doc = {"origin": origin, "size": size, "root": base64.b64encode(root).decode(), "checkpoint": note.text()}
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)  # persisted before the cosignature is handed out

    def _keep_refused(self, note: Note, why: str) -> None:
        d = self.dir / "refused"
        d.mkdir(exist_ok=True)
        stem = f"{time.time_ns()}-{why}-{hashlib.sha256(note.checkpoint.origin.encode()).hexdigest()[:12]}"
        (d / f"{stem}.txt").write_text(note.text(), encoding="utf-8")


def parse_add_checkpoint(body: bytes) -> tuple[int, list[bytes], Note]:
    """The tlog-witness add-checkpoint body: ``old N``, proof lines (base64), a blank line, the checkpoint."""
    from kvtrail.audit.note import parse_note

    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise KvtrailError("body: not UTF-8 text") from None
    head, sep, note_text = text.partition("\n\n")
    if not sep:
        raise KvtrailError("body: no blank line before the checkpoint")
    lines = head.split("\n")
    old = lines[0]
    if not old.startswith("old ") or not (old[4:] == "0" or (old[4:].isdigit() and old[4] != "0")):
        raise KvtrailError("body: the first line must be 'old <size>' (decimal, no leading zeros)")
    if len(lines) - 1 > MAX_PROOF_LINES:
        raise KvtrailError(f"body: more than {MAX_PROOF_LINES} consistency proof lines")
    proof = []
    for i, line in enumerate(lines[1:], 1):
        try:
            h = base64.b64decode(line, validate=True)
        except ValueError:
            h = b""
        if len(h) != 32:
            raise KvtrailError(f"body: proof line {i} is not base64 of a 32-byte hash")
        proof.append(h)
    return int(old[4:]), proof, parse_note(note_text, "checkpoint")
