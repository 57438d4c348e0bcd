#!/usr/bin/env bash
# kvtrail beside real SGLang, on this machine's CPU: what tests/sglang/test_real_pd.py checks, shown to a user.
#   scripts/sglang-pd-demo.sh [--dry-run] [VERSION]      (VERSION: 0.5.23, the default, or 0.5.19)
# A prefill server whose KV pool (2048 tokens) is smaller than the context it advertises (4096, as in the
# incident), a decode server, Mooncake over loopback TCP and SGLang's router in front, each server with kvtrail's
# plugin recording into its own store file; three tenants' requests and one prompt over prefill's pool through
# the router, and /health on each server (SGLang's health-check generation); then the servers are stopped
# (SIGTERM, by pid), prefill's record is merged into decode's and kvtrail's forensics judges it.
#   0.5.23: the over-long prompt is refused 400 before any transfer; no finding for any request.
#   0.5.19 (the incident's release): it is served 200 from one transferred placeholder token: F1 + F2 + F4.
# The servers run a tiny random-weight Llama made here (no hub) with the CPU flags the tests use and the test-only
# shims of tests/sglang/shims; a real deployment runs neither (docs/sglang.md). --dry-run prints the commands.
# Environment: KVTRAIL_DEMO_DIR (work folder, default a new temporary one), KVTRAIL_PYTHON (the python that runs
# the judge, with kvtrail's judge extra; default .venv/bin/python of this clone, else python3).
set -euo pipefail
dry=0
if [ "${1:-}" = --dry-run ]; then
  dry=1
  shift
fi
version=${1:-0.5.23}
cd "$(dirname "$0")/.."
root=$(pwd)
judge=${KVTRAIL_PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
if [ $dry = 1 ]; then
  py='$SGLANG_PYTHON'
  work=${KVTRAIL_DEMO_DIR:-'$WORK'}
else
  py=$(bash scripts/sglang-env.sh "$version" | tail -n 1)
  work=${KVTRAIL_DEMO_DIR:-$(mktemp -d)}
fi

# The same flags as tests/sglang/realserver.py (CPU_FLAGS) and tests/sglang/test_real_pd.py (PD_FLAGS, PD_ENV).
CPU_FLAGS=(--device cpu --attention-backend torch_native --disable-cuda-graph --skip-server-warmup --grammar-backend none --host 127.0.0.1)
PD_FLAGS=(--disaggregation-transfer-backend mooncake --disable-overlap-schedule)
PD_ENV=(MC_FORCE_TCP=1 MC_LOG_LEVEL=ERROR)
port() { "$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
if [ $dry = 1 ]; then
  prefill_port=30000 decode_port=30001 bootstrap_port=30002 router_port=30003
else
  prefill_port=$(port) decode_port=$(port) bootstrap_port=$(port) router_port=$(port)
fi
model=$work/model
node_env() { # NODE: kvtrail's plugin environment of one server
  echo env "PYTHONPATH=$root/tests/sglang/shims:$root" HF_HUB_OFFLINE=1 "KVTRAIL_DB=$work/$1.duckdb" "KVTRAIL_NODE=$1" \
    KVTRAIL_CLUSTER=sglang-demo KVTRAIL_FLUSH_INTERVAL_S=0.2 "${PD_ENV[@]}"
}
prefill_cmd=($(node_env pd-prefill) "$py" -m sglang.launch_server --model-path "$model" "${CPU_FLAGS[@]}"
  --port "$prefill_port" "${PD_FLAGS[@]}" --disaggregation-mode prefill
  --disaggregation-bootstrap-port "$bootstrap_port" --max-total-tokens 2048)
decode_cmd=($(node_env pd-decode) "$py" -m sglang.launch_server --model-path "$model" "${CPU_FLAGS[@]}"
  --port "$decode_port" "${PD_FLAGS[@]}" --disaggregation-mode decode
  --disaggregation-decode-retraction-backup cpu_tensor --max-total-tokens 4096)
router_cmd=("$py" -m sglang_router.launch_router --pd-disaggregation
  --prefill "http://127.0.0.1:$prefill_port" "$bootstrap_port" --decode "http://127.0.0.1:$decode_port"
  --host 127.0.0.1 --port "$router_port" --health-check-interval-secs 2)
model_cmd=(env "PYTHONPATH=$root" "$py" -m tests.sglang.tinymodel "$model")
merge_cmds=(
  "$judge -m kvtrail audit export --db $work/pd-prefill.duckdb --out $work/prefill-export"
  "$judge -m kvtrail audit import --db $work/pd-decode.duckdb $work/prefill-export"
  "$judge -m kvtrail forensics findings --db $work/pd-decode.duckdb"
)
if [ $dry = 1 ]; then
  printf 'model:   %s\n' "${model_cmd[*]}"
  printf 'prefill: %s\n' "${prefill_cmd[*]}"
  printf 'decode:  %s\n' "${decode_cmd[*]}"
  printf 'router:  %s\n' "${router_cmd[*]}"
  printf 'judge:   %s\n' "${merge_cmds[@]}"
  exit 0
fi

pids=()
stop() { # by pid, the processes this script started
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  pids=()
}
trap stop EXIT
ready() { # URL: wait up to 7 minutes for a 200
  for _ in $(seq 420); do
    if curl -sf -o /dev/null "$1"; then return 0; fi
    sleep 1
  done
  echo "sglang-pd-demo: $1 did not answer; logs in $work" >&2
  return 1
}
generate() { # TENANT TEXT [MAX_S]: through the router; the HTTP status (000: no answer in MAX_S s) and the answer
  local out
  for _ in $(seq 60); do # a 503 while the router has not admitted its workers yet (its /health answers first)
    out=$(curl -s --max-time "${3:-120}" -w '\n%{http_code}' -H 'content-type: application/json' \
      "http://127.0.0.1:$router_port/generate" \
      -d "{\"text\": \"$2\", \"sampling_params\": {\"max_new_tokens\": 4}, \"extra_key\": \"$1\"}" || true)
    [ "${out##*$'\n'}" = 503 ] || break
    sleep 1
  done
  echo "$1 -> HTTP ${out##*$'\n'}: $(printf '%s' "${out%$'\n'*}" | head -c 160)"
}

echo "work folder: $work"
"${model_cmd[@]}" >/dev/null
"${prefill_cmd[@]}" >"$work/prefill.log" 2>&1 &
pids+=($!)
"${decode_cmd[@]}" >"$work/decode.log" 2>&1 &
pids+=($!)
ready "http://127.0.0.1:$prefill_port/v1/models"
ready "http://127.0.0.1:$decode_port/v1/models"
"${router_cmd[@]}" >"$work/router.log" 2>&1 &
pids+=($!)
ready "http://127.0.0.1:$router_port/health"
for tenant in tenant-a tenant-b tenant-c; do
  generate "$tenant" "the $tenant asked for the pages of another request"
done
curl -s -o /dev/null -w '/health prefill -> HTTP %{http_code}\n' "http://127.0.0.1:$prefill_port/health"
curl -s -o /dev/null -w '/health decode -> HTTP %{http_code}\n' "http://127.0.0.1:$decode_port/health"
echo "the over-long prompt (~2100 tokens, over prefill's 2048-token pool, under the 4096-token context):"
generate tenant-c "$(printf 'kv cache pages move %.0s' $(seq 700))" 30
echo "(0.5.23: prefill refuses it 400 before any transfer, and the router waits on decode, which waits for a"
echo " transfer that never starts: no answer here; 0.5.19, as its real PD test shows: served 200 from one"
echo " transferred placeholder token)"
sleep 3
stop
for cmd in "${merge_cmds[@]}"; do
  echo "\$ $cmd"
  $cmd
done
