#!/usr/bin/env bash
# `make run`: the whole experiment of plans/local.toml through the coordinator and two local CPU agents.
# A coordinator on SQLite under .coop/run-TIME/coordinator, agents host-a and host-b (gloo, one thread each),
# the experiment created with autopilot on: prepare -> the singles in parallel -> the pair as a two-host
# gang -> dev evaluations -> select -> four test evaluations, then a replica per host -> serving commitment ->
# benchmarks -> report.
# Every run gets a fresh folder, so nothing recorded earlier is touched. COOP_EXIT_WHEN_DONE=1 exits once
# the report is written; otherwise the coordinator stays up for the web UI until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$PWD/.venv/bin
seed=seeds/tiny
plan=${COOP_PLAN:-plans/local.toml}
port=${COOP_PORT:-8765}
url=http://127.0.0.1:$port
run=$PWD/.coop/run-$(date -u +%Y%m%dT%H%M%SZ)
export COOP_HOME=$run/coordinator OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 COOP_REAP_SECONDS=1
mkdir -p "$run"
started=$(date +%s)
log() { echo "[$(($(date +%s) - started))s] $*"; }

pids=()
stop() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap stop EXIT
trap 'exit 130' INT TERM

if [ ! -f "$seed/model.safetensors" ]; then
  log "building the local seed into $seed (about 23 CPU-minutes, once)"
  "$bin/coop" seed-model build --out "$seed"
fi

"$bin/coop-server" migrate > /dev/null
operator=$("$bin/coop-server" token create --role operator --name operator 2> /dev/null)
"$bin/coop-server" serve --port "$port" > "$run/coordinator.log" 2>&1 &
pids+=($!)
"$bin/python" - "$url" <<'PY' || { echo "the coordinator did not start; see $run/coordinator.log" >&2; exit 1; }
import sys, time, urllib.request
for _ in range(300):
    try:
        urllib.request.urlopen(sys.argv[1] + "/api/agents", timeout=2)
        sys.exit(0)
    except OSError:
        time.sleep(0.2)
sys.exit(1)
PY
log "coordinator at $url (SQLite under $COOP_HOME)"

for host in host-a host-b; do
  token=$("$bin/coop-server" token create --role agent --name "$host" 2> /dev/null)
  COOP_AGENT_TOKEN="$token" "$bin/coop-agent" run --coordinator "$url" --name "$host" --advertise-address 127.0.0.1 \
    --work-dir "$run/$host" --model-dir "$seed" --heartbeat-seconds 5 --claim-wait-seconds 5 --batch-seconds 0.5 \
    > "$run/$host.log" 2>&1 &
  pids+=($!)
done
log "agents host-a and host-b started (logs in $run)"

export COOP_COORDINATOR=$url COOP_TOKEN=$operator
experiment=$("$bin/coop-server" experiment create --plan "$plan" | "$bin/python" -c 'import json,sys; print(json.load(sys.stdin)["id"])')
log "experiment $experiment created from $plan (autopilot on)"
"$bin/coop-server" experiment watch "$experiment"
report=$(ls "$COOP_HOME"/reports/"$experiment"/*/attempt-*/report.json | tail -n 1)
log "done: report $report (and report.html beside it; the evidence bundle in $(dirname "$report")/evidence)"
echo "web UI: $url/   answers: $url/api/experiments/$experiment/answers?role=test"
if [ "${COOP_EXIT_WHEN_DONE:-0}" = 1 ]; then
  exit 0
fi
echo "the coordinator stays up for the web UI; Ctrl-C to stop"
wait "${pids[0]}"
