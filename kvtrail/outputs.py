"""Files kvtrail writes for people: never over the audit store, never over an existing file unless
asked, never half-written, never through a symbolic link; and CSV cells that cannot run as formulas.

A file (``--out FILE``) is written beside its target and renamed over it, so a reader never sees half
a file and a symbolic link at the target is replaced, not written through. A folder of files (the
disclosure report) is written into a staging folder beside its target and renamed into place whole;
with ``force`` into a folder that holds files already, only the folder's own files of the same names
are replaced (one rename each), anything else in it is left alone.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

import polars as pl

from kvtrail.errors import KvtrailError

# A spreadsheet reads a cell starting with one of these as a formula (OWASP, "CSV Injection").
FORMULA_LEADS = ("=", "+", "-", "@", "\t", "\r")


def neutralise_csv(df: pl.DataFrame) -> pl.DataFrame:
    """``df`` with every text cell that starts with a formula character prefixed by ``'`` (OWASP's
    advice; the CSV writer then quotes and doubles quote characters as RFC 4180 says). Numeric
    columns are left as they are: a negative number stays a number."""
    text = [c for c, t in df.schema.items() if t == pl.String or isinstance(t, (pl.Categorical, pl.Enum))]
    return df.with_columns([_neutralised(pl.col(c).cast(pl.String)).alias(c) for c in text])


def _neutralised(col: pl.Expr) -> pl.Expr:
    return pl.when(col.str.slice(0, 1).is_in(FORMULA_LEADS)).then(pl.lit("'") + col).otherwise(col)


def _list_as_text(dtype: pl.DataType, col: str) -> pl.Expr:
    """A list column joined for CSV: scalars with ",", structs (evidence) as "a:b;c:d"."""
    inner = dtype.inner if isinstance(dtype, pl.List) else None
    if isinstance(inner, pl.Struct):
        fields = [f.name for f in inner.fields]
        return (
            pl.col(col)
            .list.eval(
                pl.concat_str([pl.element().struct.field(f).cast(pl.Utf8).fill_null("") for f in fields], separator=":")
            )
            .list.join(";")
        )
    return pl.col(col).list.eval(pl.element().cast(pl.Utf8).fill_null("")).list.join(",")


def csv_frame(df: pl.DataFrame) -> pl.DataFrame:
    """``df`` with every list column joined into text (CSV holds no nested values) and text cells that
    would run as a spreadsheet formula neutralised; nothing dropped."""
    joined = df.with_columns([_list_as_text(dt, c).alias(c) for c, dt in df.schema.items() if isinstance(dt, pl.List)])
    return neutralise_csv(joined)


def _store_paths(store: str | Path) -> set[str]:
    """The names a store goes by: as given (DuckDB puts its companions beside that name) and resolved."""
    given = Path(os.path.abspath(store))
    return {str(given), str(given.resolve()), str(given.parent.resolve() / given.name)}


def refuse_store(path: str | Path, protected: Iterable[str | Path], field: str = "--out") -> None:
    """Refuse ``path`` when it is one of the ``protected`` stores or a companion file of one
    (``<store>.wal``, ``<store>.workers.log``: any name that starts with the store's and a "."), through
    symbolic and hard links too; ``--force`` does not lift this."""
    real = str(Path(os.path.abspath(path)).resolve())
    for store in protected:
        same_file = os.path.exists(path) and os.path.exists(store) and os.path.samefile(path, store)
        if same_file or any(real == s or real.startswith(s + ".") for s in _store_paths(store)):
            raise KvtrailError(
                f"{field}: {path} is the audit store {store} or one of its files; "
                f"kvtrail never writes over it (choose another name)"
            )


def refuse_clobber(path: str | Path, force: bool, protected: Iterable[str | Path] = (), field: str = "--out") -> Path:
    """``path`` as a :class:`Path`, once writing it is known to be safe: not a store file
    (:func:`refuse_store`), not a folder, and not an existing file unless ``force``."""
    refuse_store(path, protected, field)
    target = Path(path)
    if target.is_dir():
        raise KvtrailError(f"{field}: {path} is a folder, not a file")
    if os.path.lexists(target) and not force:
        raise KvtrailError(f"{field}: {path} exists; add --force to replace it")
    return target


def _new_name(parent: Path, name: str) -> Path:
    """A fresh hidden name beside the target: the same filesystem, so the final rename is atomic."""
    return parent / f".{name}.{secrets.token_hex(6)}.partial"


def write_file_atomically(
    path: str | Path,
    write: Callable[[Path], None],
    *,
    force: bool,
    protected: Iterable[str | Path] = (),
    field: str = "--out",
) -> None:
    """Call ``write(tmp)`` to fill a new file beside ``path``, then rename it over ``path``: a failure
    leaves ``path`` as it was, and a symbolic link at ``path`` is replaced, never written through."""
    target = refuse_clobber(path, force, protected, field)
    parent = Path(os.path.abspath(target)).parent
    tmp = _new_name(parent, target.name)
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # mode from the umask, as open() would
    if target.is_file() and not target.is_symlink():  # a replaced file keeps its mode (e.g. kept private)
        tmp.chmod(stat.S_IMODE(target.stat().st_mode))
    try:
        write(tmp)
        refuse_clobber(path, force, protected, field)  # again: the file may have appeared meanwhile
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def check_out_dir(
    out_dir: str | Path, force: bool, protected: Iterable[str | Path] = (), field: str = "--out"
) -> list[str]:
    """The names already in ``out_dir``, once it is known to be usable: not a symbolic link, not a store
    file, a folder if it exists, and new or empty unless ``force``."""
    out = Path(out_dir)
    refuse_store(out, protected, field)
    if out.is_symlink():
        raise KvtrailError(f"{field}: {out_dir} is a symbolic link; give the folder it points to")
    if not out.exists():
        return []
    if not out.is_dir():
        raise KvtrailError(f"{field}: {out_dir} exists and is not a folder")
    existing = sorted(os.listdir(out))
    if existing and not force:
        raise KvtrailError(
            f"{field}: {out_dir} is not empty ({len(existing)} entries); give a new or empty "
            f"folder, or add --force to replace the report's files in it"
        )
    return existing


def write_dir_atomically(
    out_dir: str | Path,
    write: Callable[[Path], None],
    *,
    force: bool,
    protected: Iterable[str | Path] = (),
    last: Iterable[str] = (),
    field: str = "--out",
) -> list[str]:
    """Call ``write(staging)`` to fill a new folder beside ``out_dir``, then move it into place: renamed
    whole when ``out_dir`` is new or empty, else (``force``) file by file, the names in ``last`` after
    the others (e.g. a manifest, so that it never lists files not yet in place). A failure in ``write``
    leaves ``out_dir`` as it was. Returns the names in ``out_dir`` that were left alone."""
    out = Path(os.path.abspath(out_dir))
    existing = check_out_dir(out_dir, force, protected, field)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = _new_name(out.parent, out.name)
    staging.mkdir()
    try:
        write(staging)
        names = sorted(os.listdir(staging), key=lambda n: (n in last, n))
        if not existing:
            if out.is_dir():  # keep the empty folder's mode (an operator may have restricted it)
                staging.chmod(stat.S_IMODE(out.stat().st_mode))
            os.replace(staging, out)  # onto a missing or empty folder: one atomic rename
            return []
        _replace_each(staging, out, names, protected, field)
        return [n for n in existing if n not in names]
    finally:
        # after a failure: the error raised matters more than a staging folder left behind
        shutil.rmtree(staging, ignore_errors=True)


def _replace_each(staging: Path, out: Path, names: list[str], protected: Iterable[str | Path], field: str) -> None:
    protected = list(protected)
    for name in names:  # every target checked before anything moves
        refuse_store(out / name, protected, field)
        if (out / name).is_dir() and not (out / name).is_symlink():
            raise KvtrailError(f"{field}: {out / name} is a folder; the report would replace it with a file")
    for name in names:
        os.replace(staging / name, out / name)  # a symbolic link there is replaced itself, not followed
