"""`forensics report --signing-key`: notices/<tenant>/ folders that prove themselves offline, and
`forensics verify-notice` refusing any edited value; no other tenant's identifiers in a folder."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from kvtrail.audit.chain import generate_keypair
from tests.conftest import run_cli
from tests.forensics.incident_fixture import build

WINDOW = ["--from", "2026-09-09T00:00:00Z", "--to", "2026-09-09T06:00:00Z"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    d = tmp_path_factory.mktemp("notices")
    build(d / "i.duckdb")
    generate_keypair(d / "k.pem", d / "k.pub")
    from kvtrail.cli import main

    assert (
        main(
            [
                "forensics",
                "report",
                "--db",
                str(d / "i.duckdb"),
                *WINDOW,
                "--out",
                str(d / "rep"),
                "--signing-key",
                str(d / "k.pem"),
            ]
        )
        == 0
    )
    return d


def _verify(capsys, d, folder):
    return run_cli(capsys, "forensics", "verify-notice", str(folder), "--public-key", str(d / "k.pub"))


def test_every_affected_tenant_gets_a_folder_that_verifies_alone(made, capsys, tmp_path):
    affected = json.loads((made / "rep" / "affected_responses.json").read_text())
    exposed = json.loads((made / "rep" / "exposed_tenants.json").read_text())
    tenants = {r["tenant_id"] for r in affected if r["excluded_by"] is None}
    victims = {e["victim_tenant"] for e in exposed if e["recipient_count"]}
    folders = {p.name for p in (made / "rep" / "notices").iterdir()}
    assert victims - tenants and folders == tenants | victims  # those whose data was read get one too
    for t in tenants:
        alone = tmp_path / t
        shutil.copytree(made / "rep" / "notices" / t, alone)  # nothing but the folder
        rc, out, _ = _verify(capsys, made, alone)
        assert rc == 0, out
        doc = json.loads((alone / "responses.json").read_text())
        assert sorted(r["request_id"] for r in doc["responses"] if r["role"] == "recipient") == sorted(
            r["request_id"] for r in affected if r["tenant_id"] == t and r["excluded_by"] is None
        )
        read = [r for r in doc["responses"] if r["role"] == "victim"]
        assert bool(read) == (t in victims)
        assert all(r["request_id"].startswith("sha256:") and r["your_requests"] for r in read)
        assert all(r["evidence"] and r["codes"] and r["pages"] for r in doc["responses"])
    # the report's own manifest lists the notices, so verify-report covers them too
    assert any(name.startswith("notices/") for name in json.loads((made / "rep" / "report.json").read_text())["files"])


def test_a_folder_never_names_another_tenant(made):
    affected = json.loads((made / "rep" / "affected_responses.json").read_text())
    exposed = json.loads((made / "rep" / "exposed_tenants.json").read_text())
    everyone = {r["tenant_id"] for r in affected} | {e["victim_tenant"] for e in exposed}
    requests = {r["request_id"]: r["tenant_id"] for r in affected}
    for folder in (made / "rep" / "notices").iterdir():
        text = " ".join(p.read_text() for p in folder.iterdir())
        events = json.loads((folder / "events.json").read_text())
        assert any(e["tenant_id"].startswith("sha256:") for e in events)  # others' events are there, hashed
        for t in everyone - {folder.name}:
            assert f'"{t}"' not in text and f"{t}-" not in text.replace(f"{folder.name}-", "")
        for rid, t in requests.items():
            if t != folder.name:
                assert rid not in text


@pytest.mark.parametrize(
    "name, edit",
    [
        ("responses.json", lambda s: s.replace('"F1"', '"F5"', 1)),
        ("events.json", lambda s: s.replace('"seq": ', '"seq": 1', 1)),
        (
            "proofs.json",
            lambda s: (
                s.replace('"leaf_index": 0', '"leaf_index": 1', 1)
                if '"leaf_index": 0' in s
                else s.replace('"leaf_index": ', '"leaf_index": 0', 1)
            ),
        ),
        ("checkpoint.txt", lambda s: s.replace("\n", "\nx", 1)),
        ("notice.md", lambda s: s + "edited\n"),
    ],
)
def test_any_edited_value_fails_even_with_the_manifest_rehashed(made, capsys, tmp_path, name, edit):
    src = next((made / "rep" / "notices").iterdir())
    folder = tmp_path / "n"
    shutil.copytree(src, folder)
    (folder / name).write_text(edit((folder / name).read_text()))
    rc, out, _ = _verify(capsys, made, folder)
    assert rc == 1 and name in out[0]
    manifest = json.loads((folder / "notice.json").read_text())
    manifest["files"][name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    (folder / "notice.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    rc, out, _ = _verify(capsys, made, folder)
    assert rc == 1 and "signature" in out[0]


def test_events_that_do_not_support_the_finding_fail(made, capsys, tmp_path):
    """A validly signed folder whose listed evidence is not the response's own read fails the finding check."""
    from kvtrail.audit.chain import SignatureChecker, Signer
    from kvtrail.report.evidence import verify_notice

    src = next((made / "rep" / "notices").iterdir())
    folder = tmp_path / "n"
    shutil.copytree(src, folder)
    doc = json.loads((folder / "responses.json").read_text())
    doc["responses"][0]["pages"] = [10_000]  # pages no listed event touched
    (folder / "responses.json").write_text(json.dumps(doc))
    manifest = json.loads((folder / "notice.json").read_text())
    manifest["files"]["responses.json"] = hashlib.sha256((folder / "responses.json").read_bytes()).hexdigest()
    data = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    (folder / "notice.json").write_bytes(data)
    import base64

    (folder / "notice.sig").write_text(base64.b64encode(Signer.from_file(made / "k.pem").sign(data)).decode())
    problems = verify_notice(folder, SignatureChecker.from_file(made / "k.pub"))
    assert problems and "no listed event of this request on its pages" in problems[0]


def test_signing_key_needs_a_store_file(made, capsys, tmp_path):
    rc, _, err = run_cli(
        capsys,
        "forensics",
        "report",
        "--url",
        "http://127.0.0.1:9",
        "--token",
        "x",
        *WINDOW,
        "--out",
        str(tmp_path / "r"),
        "--signing-key",
        str(made / "k.pem"),
    )
    assert rc == 2 and "--signing-key" in err[0]
