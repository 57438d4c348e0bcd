"""The lake on object storage: export, verify and the same answers through pyarrow's S3 client, against a
local S3 server (moto) on loopback, credentials from the AWS environment variables."""

from __future__ import annotations

import pyarrow.fs as pafs
import pytest

from kvtrail import forensics as fx
from kvtrail.audit.lake.export import export_lake
from kvtrail.audit.lake.fs import LakeFS
from kvtrail.audit.lake.verify import verify_lake
from kvtrail.cli import main
from kvtrail.forensics.lake.checkpointer import write_checkpoints
from kvtrail.forensics.lake.questions import lake_findings, open_lake
from kvtrail.forensics.replay.engine import replay_store
from kvtrail.timeutil import format_utc
from tests.lake.conftest import BOUNDARY_NS

moto_server = pytest.importorskip("moto.server")


@pytest.fixture(scope="module")
def s3_endpoint():
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):
    for name, value in (
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_DEFAULT_REGION", "us-east-1"),
        ("AWS_ENDPOINT_URL", s3_endpoint),
    ):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    fs = pafs.S3FileSystem(
        endpoint_override=s3_endpoint.split("//", 1)[1],
        scheme="http",
        region="us-east-1",
        access_key="testing",
        secret_key="testing",
        allow_bucket_creation=True,
    )
    fs.create_dir("audit-lake")
    return "s3://audit-lake/eu-west"


def test_export_verify_and_ask_on_s3(s3_env, fleet_db, fleet_con, capsys, tmp_path):
    r = export_lake(fleet_db, s3_env, checkpoints=write_checkpoints)
    assert r.checkpoints > 0
    assert any(p.startswith("events/cluster=fleet-sim/") for p in LakeFS.open(s3_env).list())
    assert verify_lake(s3_env).ok
    window = (BOUNDARY_NS - 3_000_000_000, BOUNDARY_NS + 4_000_000_000)
    with open_lake(s3_env) as lake:
        assert lake_findings(lake, fx.Window(*window)) == replay_store(fleet_con, *window)
    assert main(["forensics", "affected", "--db", fleet_db, "--format", "json"]) == 0
    want = capsys.readouterr().out
    assert main(["forensics", "affected", "--lake", s3_env, "--format", "json"]) == 0
    assert capsys.readouterr().out == want
    span = ["--from", format_utc(window[0]), "--to", format_utc(window[1])]
    assert main(["forensics", "report", "--lake", s3_env, *span, "--out", str(tmp_path / "r")]) == 0
    assert main(["forensics", "verify-report", str(tmp_path / "r"), "--lake", s3_env]) == 0
    # a deleted object is named
    lake = LakeFS.open(s3_env)
    victim = next(p for p in lake.list("page_runs"))
    lake.delete(victim)
    assert main(["lake", "verify", s3_env]) == 1
    assert f"missing file: {victim}" in capsys.readouterr().err
    assert main(["forensics", "verify-report", str(tmp_path / "r"), "--lake", s3_env]) == 1
    assert f"FAILED: lake: missing file: {victim}" in capsys.readouterr().out


def test_missing_bucket_is_one_line(s3_env, fleet_db, capsys):
    assert main(["lake", "export", "--db", fleet_db, "--to", "s3://no-such-bucket/lake"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lake s3://no-such-bucket/lake: cannot" in err[0]
