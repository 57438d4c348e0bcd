#!/usr/bin/env bash
# The environment one SGLang release's tests run in, built once outside the clone and reused by every clone and
# CI run on this machine:
#   scripts/sglang-env.sh [VERSION]    (default 0.5.23; e.g. 0.5.19)  -> the environment's python, on the last line
# It lives in ${XDG_CACHE_HOME:-$HOME/.cache}/kvtrail/sglang-VERSION-HASH, HASH taken over everything it installs:
# tests/sglang/requirements-VERSION.txt (installed with --no-deps: sglang's own requirements pull CUDA kernels),
# the Python it is built with, and the environment it is layered on. A requirements file names its layer on a line
# "# kvtrail-env-layer: NAME" (requirements-NAME.txt, built the same way, first): the torch layer is shared by
# every release, 0.5.19 layers on 0.5.23. A layer is seen through a .pth file after the environment's own
# packages, which shadow it. A changed file gives a new HASH, so a new environment; once it is complete, the
# older ones of the same name are removed. A build that did not finish is never used (a stamp is written last).
# kvtrail is not installed: every run points the environment at this clone (a .pth file with the clone's path
# and kvtrail's metadata with its entry points, for SGLang's load_plugins()), so it never runs a stale copy.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
name=${1:-0.5.23}
python=${PYTHON:-python3}
reqs=tests/sglang/requirements-$name.txt
if [ ! -f "$reqs" ]; then
  echo "sglang-env: no $reqs; versions: $(ls tests/sglang/requirements-[0-9]*.txt | sed 's/.*requirements-\(.*\)\.txt/\1/' | tr '\n' ' ')" >&2
  exit 2
fi
cache=${XDG_CACHE_HOME:-$HOME/.cache}/kvtrail
mkdir -p "$cache"
layer=$(sed -n 's/^# kvtrail-env-layer: *\([A-Za-z0-9._-]*\).*/\1/p' "$reqs" | head -n 1)
layer_python=
if [ -n "$layer" ]; then
  layer_python=$(bash scripts/sglang-env.sh "$layer" | tail -n 1)
fi
key=$( { cat "$reqs"; "$python" -c 'import sys; print(sys.version)'; echo "layer: $layer_python"; } | sha256sum | cut -c1-16)
dir=$cache/sglang-$name-$key

(
  flock 9
  if [ ! -f "$dir/.kvtrail-complete" ]; then
    start=$(date +%s)
    rm -rf "$dir"
    "$python" -m venv "$dir"
    "$dir/bin/python" -m pip install -q --no-deps -r "$reqs"
    if [ -n "$layer_python" ]; then
      # After the install, so that pip sees only this environment's own packages.
      site=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
      layer_site=$("$layer_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
      echo "import site; site.addsitedir('$layer_site')" > "$site/_kvtrail_layer.pth"
    fi
    touch "$dir/.kvtrail-complete"
    echo "sglang-env: $dir built in $(( $(date +%s) - start )) s: $(du -sh "$dir" | cut -f1)" >&2
    for old in "$cache"/sglang-"$name"-*; do
      [ "$old" = "$dir" ] || [ ! -d "$old" ] || { rm -rf "$old"; echo "sglang-env: removed the older $old" >&2; }
    done
  fi
) 9>"$cache/.lock-$name"

# This clone's kvtrail, on every run: its path first on sys.path, its metadata (entry points) beside it.
"$dir/bin/python" - "$root" <<'EOF'
import json, pathlib, shutil, sys, sysconfig, tomllib

root = pathlib.Path(sys.argv[1])
site = pathlib.Path(sysconfig.get_paths()["purelib"])
project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
for old in site.glob("kvtrail-*.dist-info"):
    shutil.rmtree(old)
(site / "00-kvtrail-clone.pth").write_text(f"{root}\n")
info = site / f"kvtrail-{project['version']}.dist-info"
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kvtrail\nVersion: {project['version']}\n")
groups = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
text = "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for g, eps in groups.items())
(info / "entry_points.txt").write_text(text)
(info / "direct_url.json").write_text(json.dumps({"url": root.as_uri(), "dir_info": {"editable": True}}))
(info / "INSTALLER").write_text("scripts/sglang-env.sh\n")
files = [f"{info.name}/{n}" for n in ("METADATA", "entry_points.txt", "direct_url.json", "INSTALLER", "RECORD")]
(info / "RECORD").write_text("".join(f"{f},,\n" for f in files + ["00-kvtrail-clone.pth"]))
EOF
echo "$dir/bin/python"
