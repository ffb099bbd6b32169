#!/usr/bin/env bash
# The presets on the one-GPU machine, tpserve and the Hugging Face peers in one job: a random
# DeepSeek-Coder-6.7B-shaped bf16 checkpoint (unless $MODEL exists), hf_peers.py (eager and
# static cache + torch.compile), then run_scaling.py (tpserve serve + tpserve bench per preset),
# the table (CSV, markdown) and the plots. Everything goes to $OUT/scaling (or ./scaling-out).
# Usage: bash tools/scaling/one_gpu_job.sh [quick|full]   (quick: fewer requests per preset)
#   env: TPSERVE (default .carry/gpu/bin/tpserve, else build/tools/tpserve), MODEL (/tmp/ds67),
#        HF_MODES (eager-bf16,compile-bf16; empty: no peers), HF_PRESETS (all four),
#        HF_TIMEOUT (seconds for the peers; the presets finished by then are reported),
#        CONFIG (overrides the config)
set -uo pipefail
cd "$(dirname "$0")/../.."
size=${1:-quick}
out=${OUT:-$PWD/scaling-out}/scaling
mkdir -p "$out"
if [ -d .carry/gpu ]; then
  export LD_LIBRARY_PATH=$PWD/.carry/gpu/lib:${LD_LIBRARY_PATH:-}
  bash tools/gpu_unpack.sh .carry/gpu
fi
tpserve=${TPSERVE:-$( [ -x .carry/gpu/bin/tpserve ] && echo .carry/gpu/bin/tpserve || echo build/tools/tpserve)}
export TPSERVE_WORKER=${TPSERVE_WORKER:-$(dirname "$tpserve")/tpserve-worker}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
model=${MODEL:-/tmp/ds67}
modes=${HF_MODES-eager-bf16,compile-bf16}
config=${CONFIG:-tools/scaling/configs/one_gpu$( [ "$size" = quick ] && echo _quick).json}
log() { echo "=== $(date +%T) $*" | tee -a "$out/job.txt"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
if [ ! -f "$model/config.json" ]; then
  log "random DeepSeek-Coder-6.7B-shaped bf16 model at $model"
  "$tpserve" random-model --config tests/data/deepseek-coder-6.7b-instruct.config.json \
    --out "$model" --seed 1 --dtype bf16 2>&1 | tail -2 | tee -a "$out/job.txt"
fi
peers=()
if [ -n "$modes" ]; then
  log "HF peers: $modes"
  hf_args=()
  [ "$size" = quick ] && hf_args=(--num-requests 1 --num-conversations 8)
  timeout "${HF_TIMEOUT:-0}" python3 tools/scaling/hf_peers.py --model "$model" --modes "$modes" \
    --presets "${HF_PRESETS:-latency,batch32,batch64,chat}" --out "$out/hf" \
    "${hf_args[@]}" 2>&1 | tee -a "$out/job.txt"
  peers=(--peers "$out/hf/*.json")
fi
log "tpserve: $config"
python3 tools/scaling/run_scaling.py --config "$config" --tpserve "$tpserve" --out "$out" \
  "${peers[@]}" 2>&1 | tee "$out/run_scaling.txt" | grep -v '^I \['
rc=${PIPESTATUS[0]}
log "run_scaling rc=$rc"
cat "$out/summary.md" 2>/dev/null | tee -a "$out/job.txt"
exit "$rc"
