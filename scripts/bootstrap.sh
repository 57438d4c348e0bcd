#!/usr/bin/env bash
# Set up everything kvtrail needs in ./.venv, then run the main job or the whole test suite.
#   scripts/bootstrap.sh demo [kvtrail demo flags]   -> records PD traffic into ./kvtrail.duckdb
#   scripts/bootstrap.sh test [pytest flags]         -> the full test suite
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-demo}
[ $# -gt 0 ] && shift
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
case "$what" in
  demo)
    .venv/bin/python -m pip install -q -e .
    exec .venv/bin/kvtrail demo "$@"
    ;;
  test)
    .venv/bin/python -m pip install -q -e ".[test]"
    exec .venv/bin/python -m pytest -q "$@"
    ;;
  *)
    echo "usage: scripts/bootstrap.sh demo|test [args]" >&2
    exit 2
    ;;
esac
