"""The witness: the first checkpoint cosigned without a proof, later ones only with a valid consistency
proof, rollbacks and forks refused (exit 1 / HTTP 409 or 422) and never cosigned; the CLI and the
tlog-witness HTTP shape on a real server; `audit verify --require-cosignatures` counts its cosignatures."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys

import httpx
import pytest

from kvtrail.audit.chain import SignatureChecker, generate_keypair
from kvtrail.audit.note import cosigners, parse_note
from kvtrail.audit.witness import Witness
from kvtrail.witness.server import serve_in_thread
from tests.audit.test_tlog import _checkpoint, _fill
from tests.conftest import run_cli


@pytest.fixture
def log(tmp_path):
    """A store with a checkpoint at 4 batches (cp1), one at 8 (cp2), their proof, and a fork of it (cpf)."""
    generate_keypair(tmp_path / "log.pem", tmp_path / "log.pub")
    keys = (tmp_path / "log.pem", tmp_path / "log.pub")
    a, b = tmp_path / "a.duckdb", tmp_path / "b.duckdb"
    _fill(a, 1)
    _checkpoint(a, keys, tmp_path / "cp1")
    shutil.copy(a, b)
    _fill(a, 2, start=2, tag="x")
    _fill(b, 2, start=2, tag="y")  # the same log origin, another history
    _checkpoint(a, keys, tmp_path / "cp2")
    _checkpoint(b, keys, tmp_path / "cpf")
    return tmp_path, a, b


def _cosign(capsys, d, cp, *extra):
    return run_cli(
        capsys, "witness", "cosign", "--state", str(d / "w"), "--log-key", str(d / "log.pub"), str(d / cp), *extra
    )


def test_cli_cosigns_the_first_then_only_a_proven_extension_and_refuses_a_fork(log, capsys):
    d, a, b = log
    rc, out, err = _cosign(capsys, d, "cp1")
    assert rc == 0, err
    witness_key = SignatureChecker.from_file(d / "w" / "witness.pub")
    assert len(cosigners(parse_note("\n".join(out) + "\n"), [witness_key])) == 1
    rc, _, err = _cosign(capsys, d, "cp2")  # no proof
    assert rc == 1 and "consistency proof" in err[0]
    for db, name in ((a, "p2.json"), (b, "pf.json")):
        rc, out, _ = run_cli(capsys, "audit", "prove", "--db", str(db), "--from", str(d / "cp1"))
        (d / name).write_text("\n".join(out))
    # the fork's own (valid) proof does not make it a proof for cp2, nor cp2's for the fork
    rc, _, err = _cosign(capsys, d, "cpf", "--proof", str(d / "p2.json"))
    assert rc == 2 and "another tree" in err[0]
    rc, out, err = _cosign(capsys, d, "cp2", "--proof", str(d / "p2.json"), "--out", str(d / "cp2.cosigned"))
    assert rc == 0, err
    # now the fork: same origin, its size, a proof from cp1 valid in its own history: refused
    rc, _, err = _cosign(capsys, d, "cpf", "--proof", str(d / "pf.json"))
    assert rc == 1 and "REFUSED" in err[0]
    assert rc == 1 and "old size" in err[0]  # the witness has moved on to cp2: cp1's proof does not apply
    rc, _, err = _cosign(capsys, d, "cpf")  # same size as cp2, another root
    assert rc == 1 and "fork" in err[0]
    rc, _, err = _cosign(capsys, d, "cp1")  # a rollback
    assert rc == 1 and "rollback" in err[0]
    assert len(list((d / "w" / "refused").iterdir())) == 2  # kept as evidence, never cosigned
    rc, out, err = _cosign(capsys, d, "cp2")  # the same checkpoint again is fine
    assert rc == 0


def test_a_checkpoint_no_trusted_log_key_signed_is_refused(log, capsys):
    d, _, _ = log
    generate_keypair(d / "other.pem", d / "other.pub")
    rc, _, err = run_cli(
        capsys, "witness", "cosign", "--state", str(d / "w"), "--log-key", str(d / "other.pub"), str(d / "cp1")
    )
    assert rc == 1 and "trusted log key" in err[0]


def test_verify_requires_n_cosignatures(log, capsys):
    d, a, _ = log
    rc, _, _ = _cosign(capsys, d, "cp2", "--out", str(d / "cosigned"))
    assert rc == 0
    wkey = str(d / "w" / "witness.pub")
    base = ["audit", "verify", "--db", str(a), "--checkpoint", str(d / "cosigned"), "--public-key", str(d / "log.pub")]
    rc, out, _ = run_cli(capsys, *base, "--witness-key", wkey, "--require-cosignatures", "1")
    assert rc == 0 and any("cosigned by kvtrail-witness/" in line for line in out)
    rc, out, _ = run_cli(capsys, *base, "--require-cosignatures", "1")
    assert rc == 2  # a demand for cosignatures without trusted witness keys is bad input
    generate_keypair(d / "w2.pem", d / "w2.pub")
    rc, out, _ = run_cli(
        capsys, *base, "--witness-key", wkey, "--witness-key", str(d / "w2.pub"), "--require-cosignatures", "2"
    )
    assert rc == 1 and any("1 trusted witness cosignature(s), 2 required" in line for line in out)
    # an edited cosignature does not count
    text = (d / "cosigned").read_text()
    last = text.rstrip("\n").split("\n")[-1]
    blob = bytearray(base64.b64decode(last.split(" ")[2]))
    blob[-1] ^= 1
    (d / "edited").write_text(text.replace(last, f"{last.rsplit(' ', 1)[0]} {base64.b64encode(bytes(blob)).decode()}"))
    rc, out, _ = run_cli(
        capsys,
        *base[:-4],
        "--checkpoint",
        str(d / "edited"),
        "--public-key",
        str(d / "log.pub"),
        "--witness-key",
        wkey,
        "--require-cosignatures",
        "1",
    )
    assert rc == 1


def test_http_add_checkpoint_follows_tlog_witness(log):
    d, a, b = log
    w = Witness.open(d / "hw", [str(d / "log.pub")], None, "witness.example/w1")
    server, thread = serve_in_thread(w)
    url = f"http://127.0.0.1:{server.server_address[1]}/add-checkpoint"
    cp1, cp2, cpf = ((d / n).read_text() for n in ("cp1", "cp2", "cpf"))
    try:
        r = httpx.post(url, content=f"old 0\n\n{cp1}")
        assert r.status_code == 200 and r.text.startswith("\u2014 witness.example/w1 ")
        key = SignatureChecker.from_file(d / "hw" / "witness.pub")
        assert cosigners(parse_note(cp1 + r.text), [key]) == [
            ("witness.example/w1", cosigners(parse_note(cp1 + r.text), [key])[0][1])
        ]
        r = httpx.post(url, content=f"old 0\n\n{cp2}")  # the witness recorded 4 leaves, not 0
        assert r.status_code == 409 and r.headers["content-type"] == "text/x.tlog.size" and r.text == "4\n"
        proof = json.loads(
            subprocess.run(
                [sys.executable, "-m", "kvtrail", "audit", "prove", "--db", str(a), "--from", str(d / "cp1")],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )["proof"]
        raw = bytearray(base64.b64decode(proof[0]))
        raw[0] ^= 1
        bad = [base64.b64encode(bytes(raw)).decode(), *proof[1:]]
        r = httpx.post(url, content="old 4\n" + "".join(p + "\n" for p in bad) + "\n" + cp2)
        assert r.status_code == 422
        r = httpx.post(url, content="old 4\n" + "".join(p + "\n" for p in proof) + "\n" + cpf)  # a fork
        assert r.status_code == 422
        r = httpx.post(url, content="old 4\n" + "".join(p + "\n" for p in proof) + "\n" + cp2)
        assert r.status_code == 200
        assert httpx.post(url, content=f"old 8\n\n{cpf}").status_code == 409  # same size, another root
        assert httpx.post(url, content="old 9\n\n" + cp2).status_code == 400  # old larger than the checkpoint
        assert httpx.post(url, content=b"old x\n\n").status_code == 400
        tampered = cp2.replace("\n8\n", "\n9\n", 1)
        assert httpx.post(url, content=f"old 8\n\n{tampered}").status_code == 403
    finally:
        server.shutdown()
        thread.join(10)


def test_witness_serve_prints_its_url_and_stops_on_sigterm(log):
    d, _, _ = log
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvtrail",
            "witness",
            "serve",
            "--state",
            str(d / "sw"),
            "--log-key",
            str(d / "log.pub"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("kvtrail witness listening on http://127.0.0.1:")
        url = line.rsplit(" ", 1)[1]
        r = httpx.post(f"{url}/add-checkpoint", content=f"old 0\n\n{(d / 'cp1').read_text()}")
        assert r.status_code == 200
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
