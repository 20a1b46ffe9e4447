#!/usr/bin/env bash
# The science of the local plan end to end, without the coordinator: prepare, the three arms (singles in
# parallel, then the pair as two ranks through torchrun), select, four test evaluations, bundle, report.
# Every run gets a fresh home under .coop/, so nothing recorded earlier is touched.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.venv/bin
seed=seeds/tiny
plan=plans/local.toml
home=.coop/home-$(date -u +%Y%m%dT%H%M%SZ)
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
started=$(date +%s)
mkdir -p "$home"
log() { echo "[$(( $(date +%s) - started ))s] $*"; }

log "plan: $($bin/coop plan show $plan | tail -n 1 | cut -c1-120)"
$bin/coop prepare --plan $plan --home "$home" --model-dir $seed | tail -n 1
log "training clean-single and damaged-single in parallel"
$bin/coop train --home "$home" --model-dir $seed --arm clean-single > "$home/train-clean-single.log" & a=$!
$bin/coop train --home "$home" --model-dir $seed --arm damaged-single > "$home/train-damaged-single.log" & b=$!
wait $a; wait $b
tail -qn 1 "$home/train-clean-single.log" "$home/train-damaged-single.log"
log "training clean-pair: two ranks through torchrun"
$bin/torchrun --nproc-per-node 2 -m experiment.cli train --home "$home" --model-dir $seed --arm clean-pair \
  > "$home/train-clean-pair.log"
grep '"completed"' "$home/train-clean-pair.log"
$bin/coop select --home "$home" | tail -n 1
for arm in seed clean-single damaged-single clean-pair; do
  log "test evaluation: $arm"
  $bin/coop evaluate --home "$home" --model-dir $seed --arm $arm --role test --selection "$home/selection.json" \
    | tail -n 1
done
$bin/coop bundle --home "$home" --model-dir $seed --out "$home/evidence" | tail -n 1
$bin/coop report --home "$home/evidence" --output "$home/report.json" | tail -n 1
log "done: report $home/report.json and $home/report.html"
