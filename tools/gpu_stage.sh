#!/usr/bin/env bash
# Builds the GPU binaries here (Release, sm_90a) and stages them with the shared libraries they
# need (gRPC, protobuf, abseil...) under .carry/gpu/ for tools/gpu_job.sh on the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${TPSERVE_GPU_BUILD_DIR:-build-gpu}
# SASS for sm_90a only: without the embedded PTX (nvcc stores it compressed, so it would not
# shrink under xz) a binary carries ~4x smaller, and the H200 needs no JIT.
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTPSERVE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a-real >/dev/null
# TPSERVE_GPU_BASE replaces the default pair (e.g. to leave the engine bench out when the carried
# tree would pass its 64 MiB limit).
targets=(${TPSERVE_GPU_BASE:-tpserve tpserve-engine-bench} ${TPSERVE_GPU_TESTS:-})
ninja -C "$build" -j2 "${targets[@]}"
rm -rf .carry/gpu && mkdir -p .carry/gpu/bin
for t in "${targets[@]}"; do
  f=$(find "$build" -type f -name "$t" -perm -u+x | head -1)
  cp "$f" .carry/gpu/bin/ && strip .carry/gpu/bin/"$t"
done
bash "${TPSERVE_BUNDLE_LIBS:-../shared/tools/bundle-libs.sh}" .carry/gpu/lib .carry/gpu/bin/*
# The carried tree is limited (64 MiB): ship the big files xz-compressed; gpu_job.sh unpacks.
find .carry/gpu -type f -size +100k -exec xz -T2 -6 {} +
du -sh .carry/gpu
