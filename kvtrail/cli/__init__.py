"""The ``kvtrail`` command: the only package that imports click (one module per command group).

The base install is the recording path only; the command needs the ``judge`` extra. Without it, the
``kvtrail`` script says so in one line and exits 2 instead of a traceback."""

import sys

# What the command imports from the judge extra: a missing one of these is an install to name, not a bug.
JUDGE_MODULES = frozenset({"click", "tqdm", "polars", "yaml", "fpdf", "numba", "rich", "prometheus_client"})

try:
    from kvtrail.cli.root import cli, main
except ModuleNotFoundError as exc:
    if (exc.name or "").split(".")[0] not in JUDGE_MODULES:
        raise
    _missing = exc.name

    def main(argv: list[str] | None = None) -> int:
        sys.stderr.write(
            f"error: the kvtrail command needs the 'judge' extra (module {_missing!r} is not installed): "
            "pip install 'kvtrail[judge]'\n"
        )
        return 2


__all__ = ["cli", "main"]
