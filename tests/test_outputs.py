"""kvtrail.outputs: no output over the store or an existing file, whole-or-nothing writes, no write
through a symbolic link, CSV cells that cannot run as formulas."""

from __future__ import annotations

import os

import polars as pl
import pytest

from kvtrail.errors import KvtrailError
from kvtrail.outputs import (
    check_out_dir,
    neutralise_csv,
    refuse_clobber,
    write_dir_atomically,
    write_file_atomically,
)


@pytest.fixture
def store(tmp_path):
    db = tmp_path / "s.duckdb"
    db.write_bytes(b"store")
    return db


def test_the_store_and_its_companions_are_refused_even_with_force(store, tmp_path, monkeypatch):
    link = tmp_path / "link.csv"
    link.symlink_to(store)
    hard = tmp_path / "hard.csv"
    os.link(store, hard)
    monkeypatch.chdir(tmp_path)
    for path in (
        store,
        "s.duckdb",
        "./sub/../s.duckdb",
        store.with_name("s.duckdb.wal"),
        store.with_name("s.duckdb.workers.log"),
        link,
        hard,
    ):
        with pytest.raises(KvtrailError, match="--out: .* is the audit store"):
            refuse_clobber(path, True, protected=[store])
    assert refuse_clobber(tmp_path / "s.duckdbx", False, protected=[store]).name == "s.duckdbx"


def test_the_store_given_through_a_symlinked_folder_is_still_recognised(store, tmp_path):
    alias = tmp_path / "alias"
    alias.symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(KvtrailError, match="is the audit store"):
        refuse_clobber(tmp_path / "s.duckdb.wal", True, protected=[alias / "s.duckdb"])
    with pytest.raises(KvtrailError, match="is the audit store"):
        refuse_clobber(alias / "s.duckdb.wal", True, protected=[store])


def test_an_existing_file_needs_force_and_a_folder_is_refused(tmp_path):
    old = tmp_path / "old.csv"
    old.write_text("old")
    with pytest.raises(KvtrailError, match="--out: .*old.csv exists; add --force"):
        refuse_clobber(old, False)
    assert refuse_clobber(old, True) == old
    dangling = tmp_path / "dangling.csv"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(KvtrailError, match="exists"):
        refuse_clobber(dangling, False)
    with pytest.raises(KvtrailError, match="is a folder"):
        refuse_clobber(tmp_path, True)


def test_a_file_is_replaced_whole_or_not_at_all(tmp_path):
    out = tmp_path / "a.csv"
    out.write_text("old")

    def fail(tmp):
        tmp.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_file_atomically(out, fail, force=True)
    assert out.read_text() == "old" and os.listdir(tmp_path) == ["a.csv"]  # no partial file left
    out.chmod(0o600)
    write_file_atomically(out, lambda tmp: tmp.write_text("new"), force=True)
    assert out.read_text() == "new" and os.listdir(tmp_path) == ["a.csv"] and (out.stat().st_mode & 0o777) == 0o600
    with pytest.raises(KvtrailError, match="exists"):
        write_file_atomically(out, lambda tmp: tmp.write_text("again"), force=False)
    assert out.read_text() == "new"


def test_a_symlink_at_the_target_is_replaced_not_written_through(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    link = tmp_path / "out.csv"
    link.symlink_to(outside)
    write_file_atomically(link, lambda tmp: tmp.write_text("new"), force=True)
    assert outside.read_text() == "keep" and not link.is_symlink() and link.read_text() == "new"


def _report(files: dict[str, str]):
    def write(folder):
        for name, text in files.items():
            (folder / name).write_text(text)

    return write


def test_a_folder_is_moved_into_place_whole(tmp_path):
    out = tmp_path / "deep" / "r"
    assert write_dir_atomically(out, _report({"a.md": "a", "m.json": "m"}), force=False) == []
    assert sorted(os.listdir(out)) == ["a.md", "m.json"] and os.listdir(out.parent) == ["r"]
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o750)
    write_dir_atomically(empty, _report({"a.md": "a"}), force=False)
    assert os.listdir(empty) == ["a.md"] and (empty.stat().st_mode & 0o777) == 0o750


def test_a_failed_write_leaves_the_folder_as_it_was(tmp_path):
    def fail(folder):
        (folder / "a.md").write_text("half")
        raise RuntimeError("pdf failed")

    with pytest.raises(RuntimeError):
        write_dir_atomically(tmp_path / "new", fail, force=False)
    assert os.listdir(tmp_path) == []  # neither the folder nor a staging folder
    old = tmp_path / "old"
    old.mkdir()
    (old / "a.md").write_text("old")
    with pytest.raises(RuntimeError):
        write_dir_atomically(old, fail, force=True)
    assert os.listdir(tmp_path) == ["old"] and (old / "a.md").read_text() == "old"


def test_a_non_empty_folder_needs_force_which_replaces_only_the_reports_files(tmp_path, monkeypatch):
    out = tmp_path / "r"
    out.mkdir()
    (out / "a.md").write_text("old")
    (out / "notes.txt").write_text("mine")
    with pytest.raises(KvtrailError, match="--out: .* is not empty .*--force"):
        write_dir_atomically(out, _report({"a.md": "new"}), force=False)
    assert (out / "a.md").read_text() == "old"
    order = []
    real_replace = os.replace

    def spy(src, dst):
        order.append(os.path.basename(dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    left = write_dir_atomically(out, _report({"a.md": "new", "z.md": "z", "m.json": "m"}), force=True, last=("m.json",))
    monkeypatch.undo()
    assert left == ["notes.txt"] and order == ["a.md", "z.md", "m.json"]  # the manifest moves last
    assert (out / "a.md").read_text() == "new" and (out / "notes.txt").read_text() == "mine"


def test_no_symlink_is_followed_out_of_the_folder(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link_dir = tmp_path / "r"
    link_dir.symlink_to(elsewhere, target_is_directory=True)
    for force in (False, True):
        with pytest.raises(KvtrailError, match="symbolic link"):
            write_dir_atomically(link_dir, _report({"a.md": "a"}), force=force)
    assert os.listdir(elsewhere) == []
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim.md"
    victim.write_text("keep")
    (out / "a.md").symlink_to(victim)
    write_dir_atomically(out, _report({"a.md": "new"}), force=True)
    assert victim.read_text() == "keep" and not (out / "a.md").is_symlink() and (out / "a.md").read_text() == "new"


def test_the_folder_may_not_be_or_hold_the_store(store, tmp_path):
    with pytest.raises(KvtrailError, match="is the audit store"):
        check_out_dir(store.with_name("s.duckdb.wal"), False, protected=[store])
    with pytest.raises(KvtrailError, match="not a folder"):
        check_out_dir(tmp_path / "s.duckdb", True)
    with pytest.raises(KvtrailError, match="is the audit store"):  # a report file named like the store
        write_dir_atomically(tmp_path, _report({"s.duckdb": "x"}), force=True, protected=[store])
    assert store.read_bytes() == b"store"
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "a.md").mkdir()
    with pytest.raises(KvtrailError, match="is a folder"):
        write_dir_atomically(sub, _report({"a.md": "x"}), force=True)


def test_csv_cells_that_would_run_as_formulas_get_a_quote():
    df = pl.DataFrame(
        {
            "id": ["=1+1", "+1", "-x", "@SUM(A1)", "\tx", "\rx", "ok", "a=b", None, "", '"=q'],
            "n": [-1, 2, -3, 4, 5, 6, 7, 8, 9, 10, 11],
            "f": [-1.5] * 11,
        }
    )
    out = neutralise_csv(df)
    assert out["id"].to_list() == ["'=1+1", "'+1", "'-x", "'@SUM(A1)", "'\tx", "'\rx", "ok", "a=b", None, "", '"=q']
    assert out["n"].to_list() == df["n"].to_list() and out.schema["n"] == pl.Int64 and out["f"][0] == -1.5
    back = pl.read_csv(out.write_csv().encode())
    assert back["id"].to_list() == out["id"].to_list() and back["n"][0] == -1  # quotes escaped, RFC 4180
    cat = neutralise_csv(pl.DataFrame({"c": pl.Series(["=x", "y"], dtype=pl.Categorical)}))
    assert cat["c"].to_list() == ["'=x", "y"]
