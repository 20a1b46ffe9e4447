#!/usr/bin/env bash
# `make run`: the whole experiment of plans/local.toml (or PLAN=...) through the coordinator and one local CPU
# agent per host of the plan ([hosts] count). A coordinator on SQLite under .coop/run-TIME/coordinator, agents
# host-a, host-b, ... (gloo, one thread each), the experiment created with autopilot on. The reference plan:
# prepare -> the singles in parallel -> the pair as a two-host gang -> dev evaluations -> select -> four test
# evaluations, then a replica per host -> serving commitment -> benchmarks -> report. The local-SGD plan
# (plans/local-diloco.toml, four agents): prepare -> ddp-4 and diloco-4, each a four-host gang -> dev evaluations
# -> select -> three test evaluations -> report.
# Every run gets a fresh folder, so nothing recorded earlier is touched. COOP_EXIT_WHEN_DONE=1 exits once
# the report is written; otherwise the coordinator stays up for the web UI until Ctrl-C.
#
# HOSTS=local (the default): everything on 127.0.0.1. HOSTS=namespaces (root): the coordinator and each host in a
# network namespace of its own (scripts/namespaces.py), the agents on their own addresses, the gangs' collectives
# on the hosts' shared private link (each host's end shaped to COOP_PRIVATE_RATE, e.g. 1gbit, when set). This
# script, as the operator, reaches the coordinator over the operator's link. The namespaces are removed on exit,
# after a failure too.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$PWD/.venv/bin
plan=${COOP_PLAN:-plans/local.toml}
port=${COOP_PORT:-8765}
hosts=${HOSTS:-local}
run=$PWD/.coop/run-$(date -u +%Y%m%dT%H%M%SZ)
export COOP_HOME=$run/coordinator OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 COOP_REAP_SECONDS=1
mkdir -p "$run"
started=$(date +%s)
log() { echo "[$(($(date +%s) - started))s] $*"; }

pids=()
prefix=
stop() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [ -n "$prefix" ]; then python3 scripts/namespaces.py down --prefix "$prefix" > /dev/null; fi
}
trap stop EXIT
trap 'exit 130' INT TERM

# $(on PLACE) COMMAND...: run COMMAND on the coordinator's or a host's machine: in its namespace, or here. (Unquoted,
# so that its words prefix the command and a command put in the background is the one whose pid $! gives.)
# certificates DIR ADDRESS: a CA and the coordinator's certificate for ADDRESS, made as docs/operating.md says.
certificates() {
  local dir=$1 address=$2
  mkdir -p "$dir" && (
    cd "$dir" && umask 077
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 365 -subj "/CN=coop CA" \
      -keyout ca.key -out ca.pem \
      -addext "basicConstraints=critical,CA:TRUE,pathlen:0" -addext "keyUsage=critical,keyCertSign,cRLSign"
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=coop coordinator" \
      -keyout coordinator.key -out coordinator.csr
    printf '%s\n' "subjectAltName=IP:$address" "basicConstraints=critical,CA:FALSE" \
      "keyUsage=critical,digitalSignature" "extendedKeyUsage=serverAuth" "subjectKeyIdentifier=hash" \
      "authorityKeyIdentifier=keyid" > coordinator.ext
    openssl x509 -req -in coordinator.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 90 \
      -extfile coordinator.ext -out coordinator.pem
  ) 2> "$dir/openssl.log"
}

# One agent per host of the plan ([hosts] count, at most 8): host-a, host-b, ...
count=$("$bin/python" -c 'import sys, pathlib; from experiment.core.plan import load_plan
print(load_plan(pathlib.Path(sys.argv[1])).hosts.count)' "$plan")
letters=(a b c d e f g h)
names=()
for i in $(seq 0 $((count - 1))); do names+=("host-${letters[i]}"); done

case $hosts in
  local)
    on() { :; }
    coordinator_address=127.0.0.1
    declare -A address=() private=()
    for name in "${names[@]}"; do address[$name]=127.0.0.1; done
    scheme=http serve_tls= agent_tls=
    ;;
  namespaces)
    prefix=coop-$$
    topology=$(python3 scripts/namespaces.py up --prefix "$prefix" --hosts "$count" ${COOP_PRIVATE_RATE:+--rate "$COOP_PRIVATE_RATE"})
    echo "$topology" > "$run/topology.json"
    field() { python3 -c 'import json,sys; t=json.load(sys.stdin); print(eval(sys.argv[1]))' "$1" <<< "$topology"; }
    on() { echo "ip netns exec $prefix-$1"; }
    coordinator_address=$(field 't["coordinator_address"]')
    declare -A address private
    for i in $(seq 0 $((count - 1))); do
      name=$(field "t['hosts'][$i]['name']")
      address[$name]=$(field "t['hosts'][$i]['public_address']")
      private[$name]="--private-interface $(field "t['hosts'][$i]['private_interface']") --private-address $(field "t['hosts'][$i]['private_address']")"
    done
    # Off loopback the agents' tokens travel over TLS only: a CA, the coordinator's certificate for its address.
    certificates "$run/tls" "$coordinator_address"
    scheme=https
    serve_tls="--certfile $run/tls/coordinator.pem --keyfile $run/tls/coordinator.key"
    agent_tls="--ca-file $run/tls/ca.pem"
    export COOP_CA_FILE=$run/tls/ca.pem  # the operator's commands (coop-server experiment ...)
    ;;
  *) echo "HOSTS must be local or namespaces, not $hosts" >&2; exit 2 ;;
esac
url=$scheme://$coordinator_address:$port

# The seed the plan names, given to every agent: a packaged GGUF (seed.gguf_package) imported once into
# .coop/seeds and checked against the plan's file hashes on every run; otherwise the tiny seed of seeds/tiny.
packaged=$("$bin/python" -c 'import sys, pathlib; from experiment.core.plan import load_plan
print(load_plan(pathlib.Path(sys.argv[1])).seed.gguf_package or "")' "$plan")
if [ -n "$packaged" ]; then
  log "staging the plan's seed from $packaged under .coop/seeds (imported once, checked every run)"
  seed=$("$bin/coop" seed-model stage --plan "$plan" --cache "$PWD/.coop/seeds" \
    | "$bin/python" -c 'import json, sys; print([json.loads(l) for l in sys.stdin][-1]["dir"])')
else
  seed=seeds/tiny
  if [ ! -f "$seed/model.safetensors" ]; then
    log "building the local seed into $seed (about 23 CPU-minutes, once)"
    "$bin/coop" seed-model build --out "$seed"
  fi
fi

"$bin/coop-server" migrate > /dev/null
# The operator's token, kept for after the run (signing in, halting, exporting): readable by this user only.
(umask 077 && "$bin/coop-server" token create --role operator --name operator > "$run/operator.token" 2> /dev/null)
# shellcheck disable=SC2086 # the TLS flags are words
$(on coordinator) "$bin/coop-server" serve --host "$coordinator_address" --port "$port" $serve_tls \
  > "$run/coordinator.log" 2>&1 &
pids+=($!)
"$bin/python" - "$url" "${COOP_CA_FILE:-}" <<'PY' || { echo "the coordinator did not start; see $run/coordinator.log" >&2; exit 1; }
import ssl, sys, time, urllib.request
context = ssl.create_default_context(cafile=sys.argv[2] or None)
for _ in range(300):
    try:
        urllib.request.urlopen(sys.argv[1] + "/health", timeout=2, context=context)
        sys.exit(0)
    except OSError:
        time.sleep(0.2)
sys.exit(1)
PY
log "coordinator at $url (SQLite under $COOP_HOME)"
signin="sign in: $url/login with the token in $run/operator.token"
log "$signin"

for host in "${names[@]}"; do
  token_file=$run/$host.token
  (umask 077 && "$bin/coop-server" token create --role agent --name "$host" > "$token_file" 2> /dev/null)
  # shellcheck disable=SC2086 # the TLS and private link flags are words
  $(on "$host") "$bin/coop-agent" run --coordinator "$url" --token-file "$token_file" $agent_tls --name "$host" \
    --advertise-address "${address[$host]}" ${private[$host]:-} \
    --work-dir "$run/$host" --model-dir "$seed" --heartbeat-seconds 5 --claim-wait-seconds 5 --batch-seconds 0.5 \
    > "$run/$host.log" 2>&1 &
  pids+=($!)
done
log "agents ${names[*]} started at ${address[*]} (logs in $run)"

export COOP_COORDINATOR=$url COOP_TOKEN=$(cat "$run/operator.token")
experiment=$("$bin/coop-server" experiment create --plan "$plan" | "$bin/python" -c 'import json,sys; print(json.load(sys.stdin)["id"])')
log "experiment $experiment created from $plan (autopilot on)"
"$bin/coop-server" experiment watch "$experiment"
report=$(ls "$COOP_HOME"/reports/"$experiment"/*/attempt-*/report.json | tail -n 1)
log "done: report $report (and report.html beside it; the evidence bundle in $(dirname "$report")/evidence)"
echo "web UI: $url/   answers: $url/api/experiments/$experiment/answers?role=test"
echo "$signin"
echo "operate: coop-server experiment list|show|halt|export --coordinator $url --token-file $run/operator.token"
if [ "${COOP_EXIT_WHEN_DONE:-0}" = 1 ]; then
  exit 0
fi
echo "the coordinator stays up for the web UI; Ctrl-C to stop"
wait "${pids[0]}"
