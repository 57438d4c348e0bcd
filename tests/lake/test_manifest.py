"""The manifest is one typed definition: what it writes it reads back, every field's type is checked with
the field named, format 1 reads, and a field added to the definition is read and written with no other edit."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvtrail.audit.lake import manifest as mf
from kvtrail.audit.lake.fs import LakeFS
from kvtrail.audit.lake.manifest import FileEntry, Manifest, parse_manifest, read_manifest, write_manifest
from kvtrail.errors import KvtrailError

OLD_LAKE = Path(__file__).parent / "data" / "lake-format1"


def sample() -> Manifest:
    return Manifest(
        export_no=1,
        files={
            "batches/part-E000001.parquet": FileEntry("batches", "ab" * 32, 10, 2, 1),
            "events/cluster=c/node=n/date=1970-01-01/hour=00/part.parquet": FileEntry(
                "events", "cd" * 32, 20, 3, 1, cluster="c", node="n", hour=0, producer_id=0, batches=[0, 1]
            ),
        },
        exported_batches={"0": 1},
        chain_heads={"0": {"batch_no": 1, "digest": "ef" * 32}},
        producers={"0": {"cluster": "c", "node": "n"}},
        kvtrail_version="0",
        exported_at="2026-01-01T00:00:00+00:00",
    )


def test_what_is_written_reads_back_the_same(tmp_path):
    lake = LakeFS.open(str(tmp_path / "lake"))
    raw = write_manifest(lake, sample(), None)
    doc = json.loads(raw)
    assert "anchors" not in doc and "signature" not in doc and "store_format" not in doc  # empty: not written
    assert doc["prev_manifest_sha256"] is None and doc["format_version"] == 2
    entry = doc["files"]["events/cluster=c/node=n/date=1970-01-01/hour=00/part.parquet"]
    assert (entry["hour"], entry["producer_id"]) == (0, 0)  # zero is a value, not an empty field
    m = read_manifest(lake)
    assert (m.number, m.doc, m.raw) == (1, sample(), raw)
    assert m.next().prev_manifest_sha256 is not None and m.next().files == sample().files


def test_every_field_is_checked_and_named():
    good = sample().to_json()
    for key, value, says in [
        ("exported_batches", [], "field 'exported_batches' must be dict, not list"),
        ("export_no", "1", "field 'export_no' must be int, not str"),
        ("export_no", True, "field 'export_no' must be int, not bool"),
        ("prev_manifest_sha256", 5, "field 'prev_manifest_sha256' must be str or null, not int"),
    ]:
        with pytest.raises(KvtrailError, match=says):
            parse_manifest(json.dumps({**good, key: value}).encode(), "m.json")
    with pytest.raises(KvtrailError, match="m.json: field 'chain_heads' missing"):
        parse_manifest(json.dumps({k: v for k, v in good.items() if k != "chain_heads"}).encode(), "m.json")
    files = json.loads(json.dumps(good["files"]))
    del next(f for f in files.values() if f["table"] == "events")["hour"]
    with pytest.raises(KvtrailError, match="a events file must name its partition"):
        parse_manifest(json.dumps({**good, "files": files}).encode(), "m.json")
    with pytest.raises(KvtrailError, match="not a kvtrail-lake manifest of format_version 1 or 2"):
        parse_manifest(json.dumps({**good, "format_version": 3}).encode(), "m.json")


def test_format1_manifests_read():
    for n in (1, 2):
        raw = (OLD_LAKE / mf.manifest_name(n)).read_bytes()
        m = parse_manifest(raw, "old")
        assert m.format_version == 1 and m.store_format is None and m.export_no == n
        assert m.to_json() == {k: v for k, v in json.loads(raw).items()}  # nothing lost, nothing added


def test_a_new_field_is_one_line_of_the_definition():
    """What adding a field means: a subclass with one more field reads, checks and writes it."""
    grown = dataclasses.make_dataclass(
        "Grown", [("merkle_tree_size", "int | None", dataclasses.field(default=None))], bases=(Manifest,)
    )
    doc = {**sample().to_json(), "merkle_tree_size": 7}
    assert mf._from_json(grown, doc, "m").merkle_tree_size == 7
    assert mf._to_json(mf._from_json(grown, doc, "m"))["merkle_tree_size"] == 7
    assert mf._from_json(grown, sample().to_json(), "m").merkle_tree_size is None  # an older manifest
    with pytest.raises(KvtrailError, match="field 'merkle_tree_size' must be int or null, not str"):
        mf._from_json(grown, {**doc, "merkle_tree_size": "7"}, "m")
