#!/usr/bin/env bash
# Runs the CUDA op tests, the op benchmarks (tools/cuda_bench) and a memcheck pass on the GPU
# machine from prebuilt binaries carried in $1 (bin/, lib/). Logs go to $OUT; a short summary
# is printed last.
set -uo pipefail
C=${1:-.carry/cuda}
OUT=${OUT:-/tmp/cuda_out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=$C/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv \
  > "$OUT/gpu.txt" 2>&1
# Each test in its own process, so that a fatal check in one does not hide the others.
test_rc=0
: > "$OUT/test.log"
for t in $("$C/bin/cuda_ops_test" --gtest_list_tests | awk '/^[^ ]/{s=$1} /^  /{print s $1}'); do
  timeout 200 "$C/bin/cuda_ops_test" --gtest_filter="$t" >> "$OUT/test.log" 2>&1 || test_rc=1
done
[ -x "$C/bin/tpserve-cuda-bench" ] && timeout 200 "$C/bin/tpserve-cuda-bench" > "$OUT/bench.log" 2>&1
bench_rc=$?
san_rc=skipped
if command -v compute-sanitizer > /dev/null; then
  timeout 90 compute-sanitizer --tool memcheck --print-limit 20 "$C/bin/cuda_ops_test" \
    --gtest_filter='*Attention*:*Sample*:*Rope*:*KvWrite*' > "$OUT/memcheck.log" 2>&1
  san_rc=$?
fi
echo "==== GPU"; cat "$OUT/gpu.txt"
echo "==== test (rc $test_rc)"
grep -E "^\[ +(OK|FAILED|SKIPPED) +\]|Failure|error:|Expected|Which is|actual|rel|seed|draws|Check failed|FATAL" \
  "$OUT/test.log" | head -80
echo "==== memcheck (rc $san_rc)"
[ -f "$OUT/memcheck.log" ] && grep -E "ERROR SUMMARY|Invalid|PASSED|FAILED" "$OUT/memcheck.log" | head -12
echo "==== bench (rc $bench_rc)"
sed -n '/==== summary/,$p' "$OUT/bench.log"
[ $bench_rc -ne 0 ] && tail -20 "$OUT/bench.log"
exit 0
