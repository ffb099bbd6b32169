#!/usr/bin/env bash
# The transformers side of the GPU job alone (no tpserve binary but random-model): the fp32 vs
# bf16 noise of transformers on the random 6.7B shape, the guide's baselines (hf_bench.py) and
# the serving presets (scaling/hf_peers.py). Logs under $OUT (or ./hf-out).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/hf-out}
mkdir -p "$out"
find .carry/gpu -name "*.xz" -exec xz -d -T0 {} + 2>/dev/null
chmod +x .carry/gpu/bin/* 2>/dev/null
export LD_LIBRARY_PATH=$PWD/.carry/gpu/lib:${LD_LIBRARY_PATH:-} PYTHONUNBUFFERED=1
ds=/tmp/ds67
log() { echo "=== $(date +%T) $*" | tee -a "$out/summary.txt"; }
[ -f $ds/config.json ] || .carry/gpu/bin/tpserve random-model \
  --config tests/data/deepseek-coder-6.7b-instruct.config.json --out $ds --seed 1 --dtype bf16
prompt=$(python3 -c 'import random; r=random.Random(5); print(",".join(str(r.randrange(32256)) for _ in range(64)))')
log "transformers fp32 greedy 32 steps"
python3 tools/hf_reference.py --model $ds --prompt-ids "$prompt" --steps 32 --dtype fp32 \
  --device cuda --out /tmp/ref32.safetensors >"$out/ref32.log" 2>&1
greedy=$(python3 -c 'import json,sys; print(",".join(map(str, json.loads([l for l in open(sys.argv[1]) if l.startswith("{")][-1])["greedy_ids"])))' "$out/ref32.log")
log "transformers bf16 teacher-forced"
python3 tools/hf_reference.py --model $ds --prompt-ids "$prompt" --force-ids "$greedy" \
  --dtype bf16 --device cuda --out /tmp/ref16.safetensors >"$out/ref16.log" 2>&1
python3 tools/logits_diff.py /tmp/ref32.safetensors /tmp/ref16.safetensors >"$out/bf16_vs_fp32.jsonl" 2>&1
tail -1 "$out/bf16_vs_fp32.jsonl" | tee -a "$out/summary.txt"
for step in ${HF_JOB_STEPS:-bench peers}; do
  if [ $step = bench ]; then
    log "hf_bench"
    timeout ${HF_BENCH_TIMEOUT:-300} python3 tools/hf_bench.py --model $ds \
      --modes ${HF_MODES:-eager-bf16,eager-fp32,compile-bf16} --prompt-len 512 \
      --new-tokens ${HF_NEW_TOKENS:-128} --out "$out/hf_bench.json" >"$out/hf_bench.log" 2>&1
    log "rc=$?"; grep '^{' "$out/hf_bench.log" | tee -a "$out/summary.txt"
  fi
  if [ $step = peers ]; then
    log "hf_peers quick"
    timeout ${HF_PEERS_TIMEOUT:-300} python3 tools/scaling/hf_peers.py --model $ds \
      --modes eager-bf16,compile-bf16 --out "$out/hf_peers" --num-requests 1 \
      --num-conversations 8 >"$out/hf_peers.log" 2>&1
    log "rc=$?"; tail -5 "$out/hf_peers.log" | tee -a "$out/summary.txt"
  fi
done
log done
