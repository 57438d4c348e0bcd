"""Inputs that answered 500 (or a traceback): each is a 4xx, or exit 2 with one line, naming what is wrong."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvtrail.audit.batch import from_dicts
from kvtrail.audit.chain import generate_keypair
from kvtrail.audit.store import AuditStore
from tests.conftest import alloc, config, run_cli
from tests.service.conftest import NDJSON, arrow_body, auth, make_token

REPO = Path(__file__).resolve().parents[2]
PEM = "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n"


def _errors(r) -> list[dict]:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    return r.json()["errors"]


def test_deeply_nested_json_is_422_naming_its_line(client, producer_token):
    r = client.post("/v1/events", content=b"[" * 100_000, headers=auth(producer_token, NDJSON))
    [err] = _errors(r)
    assert r.status_code == 422 and err["field"] == "(json)" and "line 1 nests too deeply" in err["reason"]
    body = b"\n".join([b'{"seq": 0}', b'{"a":' * 100_000])
    [err] = _errors(client.post("/v1/events", content=body, headers=auth(producer_token, NDJSON)))
    assert err["field"] == "(json)" and "line 2" in err["reason"]


def test_random_bytes_as_arrow_are_422(client, producer_token):
    rnd = random.Random(31)
    for n in (4096, 64, 1):
        for prefix in (b"", b"\xff\xff\xff\xff"):  # an IPC message's continuation marker first, too
            body = prefix + bytes(rnd.getrandbits(8) for _ in range(n))
            [err] = _errors(client.post("/v1/events", content=body, headers=auth(producer_token)))
            assert err["field"] == "(arrow)" and "not a valid Arrow IPC stream" in err["reason"]


def test_a_truncated_or_corrupted_arrow_stream_is_422_at_every_cut(client, producer_token):
    body = arrow_body([config(0), alloc(1, [1, 2]), alloc(2, [3], purpose="prefix_hit", block_hashes=[5])])
    # every cut inside a message (the end-of-stream marker alone may be missing: the stream ends at EOF)
    for cut in range(1, len(body) - 8, 7):
        r = client.post("/v1/events", content=body[:cut], headers=auth(producer_token))
        [err] = _errors(r)
        assert err["field"] == "(arrow)", (cut, err)
    rnd = random.Random(7)
    for _ in range(100):  # bytes flipped: a 4xx naming the body or a field, or a batch the rules accept
        bad = bytearray(body)
        for _ in range(rnd.randint(1, 8)):
            bad[rnd.randrange(len(bad))] = rnd.getrandbits(8)
        r = client.post("/v1/events", content=bytes(bad), headers=auth(producer_token))
        assert r.status_code < 500, r.text


def test_verify_with_a_key_that_is_no_key_is_400_naming_the_public_key(service_state, client):
    operator = make_token(service_state, "operator")
    r = client.post("/v1/audit/verify", json={"public_key_pem": PEM}, headers=auth(operator, "application/json"))
    assert r.status_code == 400, r.text
    assert r.text.count("\n") == 0 and "public key: not a PEM public key" in r.json()["detail"]


def test_audit_verify_with_a_bad_public_key_exits_2_with_one_line(capsys, tmp_path, db):
    bad = tmp_path / "bad.pem"
    for text in (PEM, "not a key at all", ""):
        bad.write_text(text)
        rc, out, err = run_cli(capsys, "audit", "verify", "--db", db, "--public-key", str(bad))
        assert rc == 2 and len(err) == 1 and "public key" in err[0], (text, err)
    generate_keypair(tmp_path / "k.pem", tmp_path / "pub.pem")  # a private key where the public one goes
    rc, _, err = run_cli(capsys, "audit", "verify", "--db", db, "--public-key", str(tmp_path / "k.pem"))
    assert rc == 2 and len(err) == 1 and "public key" in err[0], err


# Runs where 'cryptography' cannot be imported (an install from before it was a base dependency).
_WITHOUT_CRYPTOGRAPHY = """
import sys
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name == 'cryptography' or name.startswith('cryptography.'):
            raise ModuleNotFoundError("No module named 'cryptography'", name=name)
sys.meta_path.insert(0, Missing())
from kvtrail.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_without_cryptography_verify_with_a_key_exits_2_naming_the_package(tmp_path, db):
    generate_keypair(tmp_path / "k.pem", tmp_path / "pub.pem")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _WITHOUT_CRYPTOGRAPHY,
            "audit",
            "verify",
            "--db",
            db,
            "--public-key",
            str(tmp_path / "pub.pem"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1 and "cryptography" in err[0], out.stderr
    assert "Traceback" not in out.stderr


def test_cryptography_is_a_base_dependency():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert any(d.split(">")[0].split("=")[0].strip() == "cryptography" for d in project["dependencies"])


@pytest.fixture
def db(tmp_path) -> str:
    path = tmp_path / "v.duckdb"
    with AuditStore(path) as s:
        s.append(from_dicts([config(0), alloc(1, [1])]))
    return str(path)
