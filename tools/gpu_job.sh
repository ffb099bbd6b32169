#!/usr/bin/env bash
# The one-GPU job: runs on the GPU machine over binaries built elsewhere (tools/gpu_stage.sh
# puts them under .carry/gpu/). Runs the gpu-tier tests, makes a random DeepSeek-Coder-6.7B-shaped
# checkpoint, compares it with transformers bf16, runs the engine benchmark and the HF
# baselines. Logs and JSON go to $OUT (or ./gpu-out) as gpu-job.tgz, beside summary.txt.
# Usage: bash tools/gpu_job.sh [tests] [ds67] [refs] [bench] [hf] [pp] [kernels] [ncu] [serve]
#          [trace] [presets] [kvq] [detserve] [pdl]
#   (default: tests ds67 bench hf; refs: the transformers references alone, without tpserve's
#   test; `refs hf` needs no tpserve binary but `tpserve random-model`; kernels: the kernel
#   benchmark tpserve-cuda-bench; ncu: Nsight Compute profiles of single kernels (NCU_ROWS, below);
#   serve: tools/serve_check.sh, served vs engine tokens;
#   pdl: tools/pdl_sass_check.py over the staged tpserve-worker and A/B variants (nc loads above
#   griddepcontrol.wait; PDL_TIMEOUT, 240 s, each)
#   presets: `tpserve bench` presets against `tpserve serve` in each SERVE_AB configuration, a
#   fresh server for each preset unless PRESETS_SHARE_SERVER=1)
#   kvq: tiny-coder held-out perplexity with each --kv-cache-dtype (the files listed in
#   .carry/heldout.txt, made by tools/tiny_coder_heldout.py --copy-to .carry/heldout), then the
#   engine benchmark of the 6.7B shape with each KV dtype in KVQ_DTYPES (KVQ_BENCH_ARGS), then
#   `tpserve kv-compare` of the 6.7B shape (fp8, int8, int4 vs bf16 KV: logits error, greedy
#   agreement; kv_compare.json); KVQ_PPL=0 skips the perplexities, KVQ_COMPARE=0 kv-compare.
#   detserve: `tpserve bench --check-deterministic` against `tpserve serve` on the 6.7B shape
#   (made when /tmp/ds67 is missing): DETSERVE_REQUESTS (64) requests of DETSERVE_PROMPT_LEN /
#   DETSERVE_OUTPUT_LEN (512 / 512) tokens, half sampled (temperature 1, seed per request), half
#   greedy, logprobs (top DETSERVE_LOGPROBS, default 1), sent all at once, then one at a time;
#   every answer compared token for token and logprob bit for bit (detserve_<mode>.json). Modes
#   in DETSERVE_MODES (default "deterministic baseline"): the server with --deterministic (every
#   answer must be identical: rc 0), and without it (differences expected, reported).
#   DETSERVE_SERVE_ARGS / DETSERVE_ARGS add serve / bench arguments; DETSERVE_TIMEOUT (500 s)
#   bounds each check (the one-at-a-time run takes most of it: 64 x 512 tokens at batch 1).
#   BENCH_ARGS adds arguments to the engine benchmark (e.g. --profile); CUDA_BENCH_ARGS to
#   tpserve-cuda-bench (e.g. --decode: every decode-attention kernel for each KV dtype).
#   REUSE_DS67=1 keeps a /tmp/ds67 that an earlier job on the same machine made (the same
#   `tpserve random-model` command) instead of making it again.
#   DS67_PROMPT_LEN sets the 6.7B comparison's prompt length (64).
#   BENCH_AB="VAR=value ...[;VAR=value ...]" runs the engine benchmark again with each of those
#   environments (baselines of an A/B comparison in the same job), with BENCH_AB_ARGS.
#   TPSERVE_GPU_STAGE: the staged folder (default .carry/gpu; gpu_stage.sh takes the same).
#   BENCH_BINS="NAME[:ARGS][;NAME[:ARGS]...]" alternates tpserve-engine-bench-NAME (a build with
#   tools/ab/NAME.patch, staged by TPSERVE_GPU_VARIANTS=NAME tools/gpu_stage.sh) with the main
#   build, BENCH_BINS_ROUNDS (2) times each, both with BENCH_AB_ARGS and ARGS.
set -uo pipefail
cd "$(dirname "$0")/.."
# Logs and JSON are written to a work folder and leave as one archive (gpu-job.tgz) plus
# summary.txt in $OUT: the device tool returns only a few files of a call.
final=${OUT:-$PWD/gpu-out}
mkdir -p "$final"
out=$(mktemp -d /tmp/gpu-job.XXXXXX)
trap 'cp "$out/summary.txt" "$final/" 2>/dev/null; tar czf "$final/gpu-job.tgz" -C "$out" .' EXIT
stage=${TPSERVE_GPU_STAGE:-.carry/gpu}  # where tools/gpu_stage.sh staged the binaries
bash tools/gpu_unpack.sh "$stage"  # tools/gpu_stage.sh compressed the big files
export LD_LIBRARY_PATH=$PWD/$stage/lib:${LD_LIBRARY_PATH:-}
export TPSERVE_SOURCE_DIR=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
steps=${*:-tests ds67 bench hf}
has() { [[ " $steps " == *" $1 "* ]]; }
log() { echo "=== $(date +%T) $*" | tee -a "$out/summary.txt"; }
# start_server NAME PORT [serve args...]: `tpserve serve` on the 6.7B shape in the background
# (pid in $spid, log in $out/serve_NAME.log), waited for until its ready file appears (120 s).
# Returns 1 at once when the server exits first (its log's last lines go to the summary), or
# when it is not ready in time: the caller skips its benchmark (in session 36 a server that
# could not start its worker cost 3 minutes of device time, waited for and then asked).
# SERVER_ENV ("VAR=value ...") is the server's environment.
start_server() {
  local name=$1 port=$2
  shift 2
  rm -f "$out/ready_$name"
  # shellcheck disable=SC2086  # SERVER_ENV is a word list
  env ${SERVER_ENV:-} "$stage/bin/tpserve" serve --model $ds --device cuda --port $port --http-port 0 \
    --worker-binary "$stage/bin/tpserve-worker" --ready-file "$out/ready_$name" "$@" \
    >"$out/serve_$name.log" 2>&1 &
  spid=$!
  for _ in $(seq 240); do
    [ -f "$out/ready_$name" ] && return 0
    if ! kill -0 $spid 2>/dev/null; then
      log "server $name exited before it was ready:"
      tail -3 "$out/serve_$name.log" | tee -a "$out/summary.txt"
      spid=
      return 1
    fi
    sleep 0.5
  done
  log "server $name was not ready after 120 s: stopped"
  kill -TERM $spid 2>/dev/null
  wait $spid 2>/dev/null
  spid=
  return 1
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
ds=/tmp/ds67
if has tests; then
  for t in "$stage"/bin/*_test; do
    [ -x "$t" ] || continue
    # Multi-process GPU tests: 2 and 4 ranks share the one GPU (through the MPI communicator, or
    # the custom all-reduce over CUDA IPC; MPS makes their kernels co-resident where it runs).
    nps=(1)
    [[ $(basename "$t") == model_parallel_* || $(basename "$t") == custom_all_reduce_* ]] && nps=(2 4)
    for np in "${nps[@]}"; do
      launcher=()
      [ "$np" -gt 1 ] && launcher=(mpirun --allow-run-as-root --oversubscribe -np $np)
      name=$(basename "$t")$([ "$np" -gt 1 ] && echo "_np$np")
      log "test $name"
      timeout ${TEST_TIMEOUT:-600} "${launcher[@]}" "$t" --gtest_color=no >"$out/$name.log" 2>&1
      rc=$?
      tail -3 "$out/$name.log" | tee -a "$out/summary.txt"
      grep -E "worst|near-ties|GB/s|TFLOP" "$out/$name.log" | head -20 >>"$out/summary.txt"
      log "rc=$rc"
    done
  done
fi
if has kvq && [ "${KVQ_PPL:-1}" = 1 ] && [ -f .carry/heldout.txt ]; then
  for d in auto fp8 int8 int4; do
    log "tpserve perplexity, tiny-coder held-out files, --kv-cache-dtype $d"
    timeout 120 "$stage/bin/tpserve" perplexity --model models/tiny-coder \
      --files-from .carry/heldout.txt --device cuda --kv-cache-dtype $d --json \
      2>"$out/ppl_$d.log" | tee -a "$out/summary.txt"
  done
fi
if { has ds67 || has refs || has bench || has hf || has serve || has trace || has presets || has kvq ||
  { has detserve && [ ! -f $ds/config.json ]; }; } &&
  ! { [ "${REUSE_DS67:-0}" = 1 ] && [ -f $ds/config.json ]; }; then
  log "random DeepSeek-Coder-6.7B-shaped model"
  /usr/bin/time -v "$stage/bin/tpserve" random-model \
    --config tests/data/deepseek-coder-6.7b-instruct.config.json --out $ds --seed 1 --dtype bf16 \
    2>&1 | grep -E "random-model|Elapsed|Maximum resident" | tee -a "$out/summary.txt"
fi
if has ds67 || has refs; then
  # transformers on the same prompt: fp32 greedy (the truth), then bf16 teacher-forced over the
  # fp32 ids, and how far bf16 lands from fp32 (the bar gpu_model_test holds us to).
  # DS67_PROMPT_LEN (64): above 256 tokens the prefill takes the GEMMs that add into the
  # residual (CudaOps::GemmAddRmsNorm), which a 64-token prompt does not.
  prompt=$(python3 -c 'import random,sys; r=random.Random(5); print(",".join(str(r.randrange(32256)) for _ in range(int(sys.argv[1]))))' "${DS67_PROMPT_LEN:-64}")
  log "transformers fp32 reference for the 6.7B shape (greedy, 32 steps)"
  python3 tools/hf_reference.py --model $ds --prompt-ids "$prompt" --steps 32 --dtype fp32 \
    --device cuda --out /tmp/ds67_ref32.safetensors >"$out/hf_ref32.log" 2>&1
  log "rc=$?"
  greedy=$(python3 -c 'import json,sys; print(",".join(map(str, json.loads([l for l in open(sys.argv[1]) if l.startswith("{")][-1])["greedy_ids"])))' "$out/hf_ref32.log")
  log "transformers bf16, teacher-forced over the fp32 greedy ids"
  python3 tools/hf_reference.py --model $ds --prompt-ids "$prompt" --force-ids "$greedy" \
    --dtype bf16 --device cuda --out /tmp/ds67_ref16.safetensors >"$out/hf_ref16.log" 2>&1
  log "rc=$?"
  python3 tools/logits_diff.py /tmp/ds67_ref32.safetensors /tmp/ds67_ref16.safetensors \
    >"$out/bf16_vs_fp32.jsonl" 2>&1
  tail -1 "$out/bf16_vs_fp32.jsonl" | tee -a "$out/summary.txt"
fi
if has ds67; then
  log "gpu_model_test on the 6.7B shape"
  TPSERVE_DS67_DIR=$ds TPSERVE_DS67_REF=/tmp/ds67_ref32.safetensors \
    TPSERVE_DS67_REF_BF16=/tmp/ds67_ref16.safetensors timeout 300 \
    "$stage/bin/gpu_model_test" --gtest_filter='*DeepSeek*' >"$out/ds67_test.log" 2>&1
  log "rc=$?"
  grep -E "deepseek|OK|FAILED|Failure" "$out/ds67_test.log" | head -20 | tee -a "$out/summary.txt"
fi
if has bench; then
  log "tpserve-engine-bench (6.7B shape, batch 1 512+512, prefill 2048, batch 8/32/64 at 1024)"
  sync; cat $ds/*.safetensors >/dev/null  # warm page cache for the load-time figure
  # SM clock, power and throttle reasons every 50 ms while the benchmarks run (sustained prefill
  # GEMMs run against the board's power limit).
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
    --format=csv -lms 50 >"$out/gpu_clocks.csv" 2>&1 &
  smi_pid=$!
  timeout 900 "$stage/bin/tpserve-engine-bench" --model $ds --device cuda ${BENCH_ARGS:-} \
    --json "$out/engine_bench.json" \
    2>&1 | tee "$out/engine_bench.log" | grep -v '^{' | tee -a "$out/summary.txt"
  IFS=';' read -ra abs <<<"${BENCH_AB:-}"
  for i in "${!abs[@]}"; do
    log "tpserve-engine-bench again with ${abs[$i]}"
    env ${abs[$i]} timeout 900 "$stage/bin/tpserve-engine-bench" --model $ds --device cuda \
      ${BENCH_AB_ARGS:-} --json "$out/engine_bench_ab$i.json" 2>&1 |
      tee "$out/engine_bench_ab$i.log" | grep -v '^{' | tee -a "$out/summary.txt"
  done
  IFS=';' read -ra bins <<<"${BENCH_BINS:-}"
  for r in $(seq "${BENCH_BINS_ROUNDS:-2}"); do
    for entry in "${bins[@]}"; do
      name=${entry%%:*}
      args=$([[ $entry == *:* ]] && echo "${entry#*:}")
      if [ ! -x "$stage/bin/tpserve-engine-bench-$name" ]; then
        log "tpserve-engine-bench-$name was not staged"
        continue
      fi
      for b in "tpserve-engine-bench-$name" tpserve-engine-bench; do
        tag=${name}_$([ "$b" = tpserve-engine-bench ] && echo main || echo variant)_$r
        log "$b ${BENCH_AB_ARGS:-} $args (round $r)"
        # shellcheck disable=SC2086  # argument lists
        timeout 900 "$stage/bin/$b" --model $ds --device cuda ${BENCH_AB_ARGS:-} $args \
          --json "$out/engine_bench_bin_$tag.json" 2>&1 |
          tee "$out/engine_bench_bin_$tag.log" | grep -v '^{' | tee -a "$out/summary.txt"
      done
    done
  done
  kill $smi_pid 2>/dev/null
fi
if has kvq; then
  sync; cat $ds/*.safetensors >/dev/null
  for d in ${KVQ_DTYPES:-auto fp8 int8 int4}; do
    log "tpserve-engine-bench --kv-cache-dtype $d ${KVQ_BENCH_ARGS:-}"
    timeout 300 "$stage/bin/tpserve-engine-bench" --model $ds --device cuda --kv-cache-dtype $d \
      ${KVQ_BENCH_ARGS:-} --json "$out/engine_bench_kv_$d.json" 2>&1 |
      tee "$out/engine_bench_kv_$d.log" | grep -E "decode|prefill|KV cache:|Error|error" |
      tee -a "$out/summary.txt"
    grep -o '"kv_capacity_tokens":[0-9]*' "$out/engine_bench_kv_$d.json" | tee -a "$out/summary.txt"
  done
fi
if has kvq && [ "${KVQ_COMPARE:-1}" = 1 ]; then
  log "tpserve kv-compare: bf16 (itself), fp8, int8, int4 vs bf16 KV, 4 prompts of 512 tokens, 64 steps"
  timeout 300 "$stage/bin/tpserve" kv-compare --model $ds --device cuda \
    --kv-cache-dtypes bf16,fp8,int8,int4 --prompts 4 --prompt-len 512 --steps 64 --json \
    >"$out/kv_compare.json" 2>"$out/kv_compare.log"
  log "rc=$?"
  grep -E "kv-compare" "$out/kv_compare.log" | tee -a "$out/summary.txt"
  python3 -c '
import json, sys
j = json.load(open(sys.argv[1]))
for r in j["results"]:
    print("kv-compare %s (stores %s) vs %s: rel err median %.3g mean %.3g max %.3g over %d rows, "
          "top-1 %.4f; greedy first divergence mean %.1f of %d, all-match %.2f, tokens equal %.4f"
          % (r["kv_cache_dtype"], r["stored_kv_cache_dtype"], j["baseline_kv_cache_dtype"],
             r["rel_error_median"], r["rel_error_mean"], r["rel_error_max"], r["rows"],
             r["top1_agreement"], r["greedy_first_divergence_mean"], j["steps"],
             r["greedy_all_match_fraction"], r["greedy_token_match_fraction"]))
' "$out/kv_compare.json" 2>&1 | tee -a "$out/summary.txt"
fi
if has trace; then
  # Nsight Systems timeline of batch-1 decode with every CUDA-graph node traced: the time of each
  # kernel inside the replayed graph (the op profiler can only time eager steps).
  nsys=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1)
  if [ -n "$nsys" ]; then
    log "nsys trace of batch-1 decode ($nsys)"
    timeout 240 "$nsys" profile --cuda-graph-trace=node --trace=cuda -o /tmp/decode_trace -f true \
      "$stage/bin/tpserve-engine-bench" --model $ds --device cuda --prompt-len 512 --new-tokens 64 \
      --prefill-len 512 --batches 1 --context 512 --repeats 1 >"$out/trace_bench.log" 2>&1
    log "rc=$?"
    "$nsys" stats --report cuda_gpu_kern_sum --format csv -o /tmp/decode_kern /tmp/decode_trace.nsys-rep \
      >/dev/null 2>&1
    "$nsys" stats --report cuda_gpu_trace --format csv -o /tmp/decode_gputrace \
      /tmp/decode_trace.nsys-rep >/dev/null 2>&1
    cp /tmp/decode_kern*.csv "$out/" 2>/dev/null
    xz -T0 -c /tmp/decode_gputrace*.csv >"$out/decode_gputrace.csv.xz" 2>/dev/null
    head -25 "$out"/decode_kern*.csv | tee -a "$out/summary.txt"
  else
    log "no nsys on this machine"
  fi
fi
if has pdl; then
  # Loads ptxas scheduled above griddepcontrol.wait in the staged binaries (their cubins, with
  # this machine's cuobjdump and nvdisasm: tools/pdl_sass_check.py).
  # The staged binaries link the same CUDA library, so the worker (what serves) and each A/B
  # variant (its patched kernels) are checked, one at a time: all eight at once had not finished
  # after 225 s on an H100 (session 35), and the call ended without a line of their output.
  for b in "$stage/bin/tpserve-worker" "$stage"/bin/tpserve-engine-bench-*; do
    [ -x "$b" ] || continue
    log "pdl_sass_check $(basename "$b")"
    timeout ${PDL_TIMEOUT:-240} python3 tools/pdl_sass_check.py "$b" \
      >"$out/pdl_sass_check_$(basename "$b").log" 2>&1
    log "rc=$?"
    tail -5 "$out/pdl_sass_check_$(basename "$b").log" | tee -a "$out/summary.txt"
  done
fi
if has kernels && [ -x "$stage/bin/tpserve-cuda-bench" ]; then
  log "tpserve-cuda-bench"
  timeout 300 "$stage/bin/tpserve-cuda-bench" ${CUDA_BENCH_ARGS:-} >"$out/cuda_bench.log" 2>&1
  log "rc=$?"
  sed -n '/==== summary/,$p' "$out/cuda_bench.log" | tee -a "$out/summary.txt"
fi
if has ncu && [ -x "$stage/bin/tpserve-cuda-bench" ]; then
  # Nsight Compute profiles of single kernels (it reads the hardware counters on this machine;
  # --clock-control none leaves the clocks alone): each NCU_ROWS entry "NAME MODE SKIP COUNT REGEX"
  # (";"-separated) profiles COUNT launches, after SKIP warm-ups, of the tpserve-cuda-bench MODE
  # rows that REGEX matches. ncu_NAME.txt: the details page (speed of light, warp states, memory
  # tables); sass_NAME.csv: the warp-stall samples per SASS instruction.
  rows=${NCU_ROWS:-"lt_qkv64 --stream 10 1 ^qkv 12288x4096 M=64 cuBLASLt;st_qkv64 --stream 10 1 ^qkv 12288x4096 M=64 stream \(auto\) n64 x128 rows, 4 stages\$;fp8dec --attention 10 2 decode attention B=64 ctx 1024 fp8 auto;bf16dec --attention 10 2 decode attention B=64 ctx 1024 bf16 auto;prefill --attention 4 1 prefill attention"}
  IFS=';' read -ra entries <<<"$rows"
  for e in "${entries[@]}"; do
    read -r name mode skip count rx <<<"$e"
    log "ncu $name ($mode '$rx')"
    timeout 200 ncu --clock-control none --set detailed --section WarpStateStats \
      --section SchedulerStats --section MemoryWorkloadAnalysis_Tables \
      --metrics sm__cycles_active.max,sm__cycles_active.min,sm__cycles_active.avg,dram__bytes_read.sum \
      --launch-skip "$skip" --launch-count "$count" -o "/tmp/ncu_$name" \
      "$stage/bin/tpserve-cuda-bench" "$mode" "$rx" >"$out/ncu_$name.log" 2>&1
    log "rc=$?"
    ncu -i "/tmp/ncu_$name.ncu-rep" --page details --print-details all >"$out/ncu_$name.txt" 2>&1
    ncu -i "/tmp/ncu_$name.ncu-rep" --page source --print-source sass --csv \
      >"$out/sass_$name.csv" 2>&1
    grep -E "^  [A-Za-z_].*\(|Duration|DRAM Throughput|sm__cycles_active|Registers Per|Achieved Occ" \
      "$out/ncu_$name.txt" | head -12 | tee -a "$out/summary.txt"
  done
fi
if has serve; then
  # Served vs engine greedy tokens: the 6.7B shape with and without the workers' decode graphs,
  # the same with cuBLASLt's timed algorithm choice off (it may pick differently in two
  # processes, and a random-weight model has many near-ties), and tiny-coder (a trained model).
  for v in "$ds 1 1" "$ds 0 1" "$ds 1 0" "$PWD/models/tiny-coder 1 1"; do
    set -- $v
    log "tools/serve_check.sh MODEL=$1 TPSERVE_WORKER_CUDA_GRAPHS=$2 TPSERVE_CUBLASLT_AUTOTUNE=$3"
    MODEL=$1 TPSERVE_WORKER_CUDA_GRAPHS=$2 TPSERVE_CUBLASLT_AUTOTUNE=$3 \
      OUT="$out/serve_check_$(basename $1)_$2_$3" timeout 200 \
      bash tools/serve_check.sh 2>&1 | tail -3 | tee -a "$out/summary.txt"
  done
fi
if has presets; then
  # Served presets on the 6.7B shape, each server configuration in SERVE_AB
  # ("label:serve flags[:presets[:VAR=value ...]];...", the last field the server's environment),
  # beside the engine figures of the `bench` step of the same
  # job. PRESETS names the default presets; PRESET_ARGS_<preset> adds `tpserve bench` arguments
  # (e.g. PRESET_ARGS_latency="--compare-engine /tmp/ds67 --engine-device cuda").
  # Each preset runs against a server of its own, so that none starts with the prefix cache of
  # another (batch128's first 128 prompts are batch64's: after it, half its prompt tokens were
  # cache hits, 7,642 against 6,400 output tokens/s cold, H200 2026-12-06). PRESETS_SHARE_SERVER=1
  # runs a configuration's presets on one server, as before.
  IFS=';' read -ra configs <<<"${SERVE_AB:-default:}"
  for c in "${configs[@]}"; do
    IFS=':' read -r label flags config_presets config_env <<<"$c"
    config_presets=${config_presets:-${PRESETS:-latency batch64 chat}}
    log "serve $label (${flags:-no extra flags}${config_env:+, env $config_env}): presets $config_presets"
    share=${PRESETS_SHARE_SERVER:-0}
    # stop_server NAME: the server's `tpserve info` into info_NAME.txt, then SIGTERM and wait.
    stop_server() {
      "$stage/bin/tpserve" info --server 127.0.0.1:50078 >"$out/info_$1.txt" 2>&1
      kill -TERM $spid
      wait $spid
      spid=
    }
    spid=
    for preset in $config_presets; do
      if [ -z "$spid" ]; then
        name=$label
        [ "$share" != 1 ] && name=${label}_$preset
        # shellcheck disable=SC2086  # flags and config_env are word lists
        SERVER_ENV="$config_env" start_server "$name" 50078 $flags || continue
      fi
      extra_var="PRESET_ARGS_${preset//-/_}"
      timeout 400 "$stage/bin/tpserve" bench --server 127.0.0.1:50078 --preset $preset \
        --no-progress --label "$label" --json "$out/preset_${label}_$preset.json" \
        ${!extra_var:-} >"$out/preset_${label}_$preset.log" 2>&1
      python3 - "$out/preset_${label}_$preset.json" "$label" "$preset" <<'PY' | tee -a "$out/summary.txt"
import json, sys
try:
    j = json.load(open(sys.argv[1]))
except Exception as e:
    print(json.dumps({"label": sys.argv[2], "preset": sys.argv[3], "error": str(e)})); sys.exit()
keep = {k: j.get(k) for k in ("completed", "failed", "output_throughput", "duration_s")}
for k in ("tpot_ms", "ttft_ms", "e2e_ms"):
    keep[k + "_p50"] = (j.get(k) or {}).get("median")
keep.update({k: v for k, v in j.items()
             if k.startswith("prefix") or k.startswith("engine") or k == "server_steps"})
print(json.dumps({"label": sys.argv[2], "preset": sys.argv[3], **keep}))
PY
      [ "$share" != 1 ] && stop_server "$name"
    done
    [ -n "$spid" ] && stop_server "$name"
  done
fi
if has detserve; then
  # Issue 22: "64 concurrent 512/512 served: all 64 answers identical to the same requests run one
  # at a time" (with --deterministic); the same without it is the baseline, reported, not asserted.
  n=${DETSERVE_REQUESTS:-64} plen=${DETSERVE_PROMPT_LEN:-512} olen=${DETSERVE_OUTPUT_LEN:-512}
  for mode in ${DETSERVE_MODES:-deterministic baseline}; do
    flags=()
    [ "$mode" = deterministic ] && flags=(--deterministic)
    log "detserve $mode: serve ${flags[*]:-(default)}; $n requests of $plen / $olen tokens at once, then one at a time"
    # shellcheck disable=SC2086  # DETSERVE_SERVE_ARGS is a word list
    start_server "detserve_$mode" 50079 "${flags[@]}" ${DETSERVE_SERVE_ARGS:-} || continue
    timeout ${DETSERVE_TIMEOUT:-500} "$stage/bin/tpserve" bench --server 127.0.0.1:50079 \
      --check-deterministic --num-requests $n --prompt-len $plen --output-len $olen \
      --logprobs ${DETSERVE_LOGPROBS:-1} --no-progress --label "detserve_$mode" \
      --json "$out/detserve_$mode.json" ${DETSERVE_ARGS:-} >"$out/detserve_$mode.log" 2>&1
    rc=$?
    grep -E "^(server|requests|lengths|all at once|one at a time|identical answers|  request|note|result)|tpserve bench:" \
      "$out/detserve_$mode.log" | head -30 | tee -a "$out/summary.txt"
    python3 - "$out/detserve_$mode.json" "$mode" <<'PY' | tee -a "$out/summary.txt"
import json, sys
try:
    c = json.load(open(sys.argv[1]))["deterministic_check"]
except Exception as e:
    print(json.dumps({"detserve": sys.argv[2], "error": str(e)})); sys.exit()
keep = {k: c[k] for k in ("passed", "server_deterministic", "requests", "identical", "differing",
                          "failed", "sampled", "greedy")}
for k in ("first_difference", "first_token_difference"):
    keep[k] = {s: c[k][s] for s in ("count", "min", "median", "max")}
kinds = {}
for d in c["differences"]:
    kinds[d["divergence"]] = kinds.get(d["divergence"], 0) + 1
keep["divergences"] = kinds
keep["seconds"] = [round(c["concurrent"]["duration_s"], 2), round(c["sequential"]["duration_s"], 2)]
keep["server_steps"] = [c["concurrent"]["server_steps"], c["sequential"]["server_steps"]]
print(json.dumps({"detserve": sys.argv[2], **keep}))
PY
    log "detserve $mode rc=$rc (0: every answer identical; 1: some differ or failed)"
    kill -TERM $spid; wait $spid
  done
fi
if has hf; then
  log "HF transformers baselines"
  timeout ${HF_BENCH_TIMEOUT:-900} python3 tools/hf_bench.py --model $ds --modes ${HF_MODES:-eager-bf16,eager-fp32,compile-bf16} \
    --prompt-len 512 --new-tokens ${HF_NEW_TOKENS:-128} --out "$out/hf_bench.json" \
    >"$out/hf_bench.log" 2>&1
  log "hf_bench rc=$?"
  grep '^{' "$out/hf_bench.log" | tee -a "$out/summary.txt"
fi
if has pp && [ -x "$stage/bin/model_parallel_bench" ]; then
  # CPU pipeline of 2 stages on tiny-coder (16 cores here): one micro-batch vs two in flight.
  for m in 1 2; do
    log "model_parallel_bench pp=2 batch 8, micro-batches $m"
    OPENBLAS_NUM_THREADS=1 timeout 120 mpirun --allow-run-as-root -np 2 \
      "$stage/bin/model_parallel_bench" --pp 2 --batch 8 --new-tokens 64 --micro-batches $m \
      --model models/tiny-coder 2>&1 | grep "rank 0" | tee -a "$out/summary.txt"
  done
fi
log done
