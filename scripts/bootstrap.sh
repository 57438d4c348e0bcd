#!/usr/bin/env bash
# Set up everything kvtrail needs in ./.venv, then run the main job or the whole test suite.
#   scripts/bootstrap.sh demo [kvtrail demo flags]   -> records PD traffic into ./kvtrail.duckdb
#   scripts/bootstrap.sh test [pytest flags]         -> ruff, mypy, then the full test suite
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-demo}
[ $# -gt 0 ] && shift
python=${PYTHON:-python3}

# Debian libraries the Mooncake transfer engine links against (the reference serving stack), and the
# Unicode fonts of the PDF report (DejaVu: Latin, Greek, Cyrillic; WenQuanYi Micro Hei: Chinese, Japanese,
# Korean). The tests also read PDFs back as text (pdftotext, from poppler-utils).
debs=(libibverbs1 libnuma1 libcurl4 fonts-dejavu-core fonts-wqy-microhei)
[ "$what" = test ] && debs+=(poppler-utils)
# The alert rules' tests: promtool, and a real Prometheus and Alertmanager end to end (test only).
[ "$what" = test ] && debs+=(prometheus prometheus-alertmanager)
# The dashboard's browser test: Debian's chromium, which Playwright drives (no browser download; test only).
[ "$what" = test ] && debs+=(chromium)
need_debs=()
for pkg in "${debs[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_debs+=("$pkg")
done
if [ ${#need_debs[@]} -gt 0 ]; then
  sudo_cmd=(); [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${need_debs[@]}" >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
case "$what" in
  demo)
    .venv/bin/python -m pip install -q -e ".[serving]"
    exec .venv/bin/kvtrail demo "$@"
    ;;
  test)
    .venv/bin/python -m pip install -q -e ".[test]"
    # Lint and types first: they take seconds and name the line.
    .venv/bin/ruff check .
    .venv/bin/ruff format --check .
    .venv/bin/mypy
    # The SGLang plugin's tests run in their own environments with the real sglang wheels, 0.5.23 and the
    # incident's 0.5.19 (built once under ~/.cache/kvtrail/, reused by every clone while their
    # requirements are unchanged); in ./.venv only the release-wheel checks of tests/sglang run.
    sglang_latest=$(bash scripts/sglang-env.sh 0.5.23 | tail -n 1)
    sglang_incident=$(bash scripts/sglang-env.sh 0.5.19 | tail -n 1)
    # The main suite on one worker per core (pytest-xdist; tests that wait on servers and subprocesses
    # leave a core idle when run one at a time): the cores this process may run on, fewer where a cgroup
    # quota allows fewer, and at most one worker per 3 GiB of available memory. Flags given after `test`
    # come last and win: `-n 0` runs the suite in this process.
    workers=$(.venv/bin/python scripts/test-workers.py)
    .venv/bin/python -m pytest -q -n "$workers" --dist worksteal "$@"
    "$sglang_latest" -m pytest -q -p no:cacheprovider tests/sglang
    exec "$sglang_incident" -m pytest -q -p no:cacheprovider tests/sglang
    ;;
  *)
    echo "usage: scripts/bootstrap.sh demo|test [args]" >&2
    exit 2
    ;;
esac
