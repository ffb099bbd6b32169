#!/usr/bin/env bash
# Quick GPU check of the service against the in-process engine (run on the GPU machine over
# binaries staged by tools/gpu_stage.sh): the same greedy prompt through `tpserve run` (engine,
# CUDA graphs) and through `tpserve serve` + `tpserve generate` must give the same tokens; then
# the latency preset's TPOT. Logs under $OUT (or ./serve-check-out). MODEL (default /tmp/ds67,
# made if missing); TPSERVE_WORKER_CUDA_GRAPHS=0 serves without the workers' decode graphs;
# KV_CACHE_DTYPE (default auto) runs both sides with that --kv-cache-dtype.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/serve-check-out}
mkdir -p "$out"
bash tools/gpu_unpack.sh .carry/gpu
export LD_LIBRARY_PATH=$PWD/.carry/gpu/lib:${LD_LIBRARY_PATH:-}
b=.carry/gpu/bin
model=${MODEL:-/tmp/ds67}
[ -f "$model/config.json" ] || "$b/tpserve" random-model \
  --config tests/data/deepseek-coder-6.7b-instruct.config.json --out "$model" --seed 1 --dtype bf16 >/dev/null
vocab=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$model/config.json")
ids=$(python3 -c 'import random,sys; r=random.Random(7); print(",".join(str(r.randrange(int(sys.argv[1]))) for _ in range(48)))' "$vocab")
kv=(--kv-cache-dtype "${KV_CACHE_DTYPE:-auto}")
"$b/tpserve" run --model "$model" --device cuda --prompt-ids "$ids" --max-new-tokens 64 --ignore-eos \
  --kv-cache-mb 4096 "${kv[@]}" --json > "$out/engine.json" 2>"$out/engine.log"
TPSERVE_WORKER_CUDA_GRAPHS=${TPSERVE_WORKER_CUDA_GRAPHS:-1} "$b/tpserve" serve --model "$model" --device cuda --port 50077 --kv-cache-mb 8192 "${kv[@]}" \
  --worker-binary "$b/tpserve-worker" --ready-file "$out/ready" >"$out/serve.log" 2>&1 &
pid=$!
for _ in $(seq 240); do [ -f "$out/ready" ] && break; sleep 0.5; done
"$b/tpserve" generate --server 127.0.0.1:50077 --prompt-ids "$ids" --max-new-tokens 64 \
  --ignore-eos --json > "$out/served.json" 2>"$out/generate.log" || tail -3 "$out/generate.log"
"$b/tpserve" bench --server 127.0.0.1:50077 --preset latency --num-requests 2 --no-progress \
  --json "$out/latency.json" > "$out/bench.log" 2>&1
kill -TERM $pid; wait $pid
python3 - "$out" <<'PY'
import json, sys
d = sys.argv[1]
e = json.load(open(d + "/engine.json"))
s = json.load(open(d + "/served.json"))
ei = e.get("output_ids") or e.get("token_ids")
si = s.get("token_ids") or s.get("tokenIds") or s.get("output_ids")
lat = json.load(open(d + "/latency.json"))
first = next((i for i, (a, b) in enumerate(zip(ei, si)) if a != b), None)
print(json.dumps({"equal": ei == si, "first_difference": first,
                  "engine_ids": ei[:8], "served_ids": si[:8], "n": [len(ei), len(si)],
                  "around_difference": None if first is None else
                      [ei[max(0, first - 2):first + 3], si[max(0, first - 2):first + 3]],
                  "tpot_ms_median": lat.get("tpot_ms", {}).get("median", lat.get("tpot_ms_median"))}))
PY
