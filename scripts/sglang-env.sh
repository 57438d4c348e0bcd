#!/usr/bin/env bash
# Build (once) the separate environment the SGLang plugin's tests run in: ./.venv-sglang, never ./.venv.
#   scripts/sglang-env.sh            -> prints the environment's python on the last line
# The real sglang wheel and what its modules import on CPU come from tests/sglang/requirements.txt,
# installed with --no-deps (sglang's own requirements pull torch 2.14.1 with CUDA and GPU-only kernels).
# The environment is built once and brought back to that file's pins when it changes (a hash stamp inside
# it: changed pins are installed, packages it no longer names removed); kvtrail is installed
# editable, without its dependencies (they are pinned in the same file), again when pyproject.toml changes.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
env_dir=.venv-sglang
reqs=tests/sglang/requirements.txt
want=$(sha256sum "$reqs" | cut -d' ' -f1)
have=$(cat "$env_dir/.kvtrail-reqs-sha256" 2>/dev/null || true)
if [ ! -x "$env_dir/bin/python" ]; then
  start=$(date +%s)
  rm -rf "$env_dir"
  "$python" -m venv "$env_dir"
  "$env_dir/bin/python" -m pip install -q --no-deps -r "$reqs"
  echo "$want" > "$env_dir/.kvtrail-reqs-sha256"
  rm -f "$env_dir/.kvtrail-project-sha256"
  echo "sglang test environment built in $(( $(date +%s) - start )) s: $(du -sh "$env_dir" | cut -f1)" >&2
elif [ "$want" != "$have" ]; then
  # The pins changed: install them over the environment (pip keeps what already matches), then remove
  # whatever the file no longer pins, so the environment is again exactly the file (plus kvtrail).
  start=$(date +%s)
  "$env_dir/bin/python" -m pip install -q --no-deps -r "$reqs"
  norm() { tr 'A-Z_.' 'a-z--'; }
  pinned=$(sed -n 's/^\([A-Za-z0-9_.-]*\)==.*/\1/p' "$reqs" | norm | sort -u)
  installed=$("$env_dir/bin/python" -m pip list --format=freeze --exclude-editable 2>/dev/null \
    | sed -n 's/^\([A-Za-z0-9_.-]*\)==.*/\1/p' | norm | sort -u)
  stale=$(comm -23 <(echo "$installed") <(echo "$pinned") | grep -vx -e pip -e setuptools -e wheel -e kvtrail || true)
  if [ -n "$stale" ]; then
    # shellcheck disable=SC2086 # one package name per word
    "$env_dir/bin/python" -m pip uninstall -q -y $stale
  fi
  echo "$want" > "$env_dir/.kvtrail-reqs-sha256"
  echo "sglang test environment updated in $(( $(date +%s) - start )) s: $(du -sh "$env_dir" | cut -f1)" >&2
fi
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
have=$(cat "$env_dir/.kvtrail-project-sha256" 2>/dev/null || true)
if [ "$want" != "$have" ]; then
  # kvtrail's entry point (group sglang.srt.plugins) is what SGLang's load_plugins() discovers.
  "$env_dir/bin/python" -m pip install -q --no-deps -e .
  echo "$want" > "$env_dir/.kvtrail-project-sha256"
fi
echo "$env_dir/bin/python"
