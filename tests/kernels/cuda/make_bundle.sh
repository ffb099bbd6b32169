#!/usr/bin/env bash
# Builds the CUDA op tests and benchmark in BUILD (default build-cuda) and packs them with their
# non-CUDA shared libraries into .carry/cudax/cuda.tar.xz for the GPU machine. There:
#   mkdir -p /tmp/c && tar -xJf .carry/cudax/cuda.tar.xz -C /tmp/c &&
#   OUT=$OUT bash tests/kernels/cuda/device_run.sh /tmp/c      (carry: [".carry/cudax"])
set -euo pipefail
build=${1:-build-cuda}
targets=cuda_ops_test
ninja -C "$build" -t targets all | grep -q '^tpserve-cuda-bench:' && targets="$targets tpserve-cuda-bench"
ninja -C "$build" -j2 $targets
rm -rf .carry/cuda && mkdir -p .carry/cuda/bin .carry/cudax
cp "$build/tests/kernels/cuda/cuda_ops_test" .carry/cuda/bin/
[ -f "$build/tools/cuda_bench/tpserve-cuda-bench" ] && cp "$build/tools/cuda_bench/tpserve-cuda-bench" .carry/cuda/bin/
strip .carry/cuda/bin/*
/work/shared/tools/bundle-libs.sh .carry/cuda/lib .carry/cuda/bin/*
strip --strip-unneeded .carry/cuda/lib/*.so* 2>/dev/null || true
tar -cJf .carry/cudax/cuda.tar.xz -C .carry/cuda bin lib
ls -la .carry/cudax/cuda.tar.xz
