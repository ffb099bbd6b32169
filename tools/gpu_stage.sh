#!/usr/bin/env bash
# Builds the GPU binaries here (Release, sm_90a) and stages them with the shared libraries they
# need (gRPC, protobuf, abseil...) under .carry/gpu/ for tools/gpu_job.sh on the GPU machine.
# TPSERVE_GPU_STAGE names another folder (e.g. .carry/gpu2, so that a staged set stays whole
# for calls while the next one builds; gpu_job.sh takes the same variable).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${TPSERVE_GPU_STAGE:-.carry/gpu}
build=${TPSERVE_GPU_BUILD_DIR:-build-gpu}
# SASS for sm_90a only: without the embedded PTX (nvcc stores it compressed, so it would not
# shrink under xz) a binary carries ~4x smaller, and the H200 needs no JIT.
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTPSERVE_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90a-real >/dev/null
# TPSERVE_GPU_BASE replaces the default pair (e.g. to leave the engine bench out when the carried
# tree would pass its 64 MiB limit).
targets=(${TPSERVE_GPU_BASE:-tpserve tpserve-engine-bench} ${TPSERVE_GPU_TESTS:-})
ninja -C "$build" -j2 "${targets[@]}"
# stage TARGET [NAME]: the built TARGET, stripped, as $dest/bin/NAME (default TARGET).
stage() {
  local f
  f=$(find "$build" -type f -name "$1" -perm -u+x | head -1)
  cp "$f" "$dest/bin/${2:-$1}" && strip "$dest/bin/${2:-$1}"
}
rm -rf "$dest" && mkdir -p "$dest/bin"
for t in "${targets[@]}"; do stage "$t"; done
# TPSERVE_GPU_VARIANTS="NAME ...": the engine benchmark built again with tools/ab/NAME.patch
# applied, staged as tpserve-engine-bench-NAME (the baseline of an A/B in one job: gpu_job.sh's
# BENCH_BINS). The working tree is patched for the build and restored after it, also on failure.
# TPSERVE_GPU_VARIANT_TESTS="X_test ..." builds those tests with each patch too, staged as
# X_NAME_test (NAME's dashes as underscores), which gpu_job.sh's tests step runs beside main's:
# a patch's bits are checked before it is adopted.
for v in ${TPSERVE_GPU_VARIANTS:-}; do
  patch=tools/ab/$v.patch
  git apply --check "$patch" || { echo "gpu_stage.sh: $patch does not apply to this tree" >&2; exit 1; }
  git apply "$patch"
  trap 'git apply -R "'"$patch"'"' EXIT
  vtests=(${TPSERVE_GPU_VARIANT_TESTS:-})
  ninja -C "$build" -j2 tpserve-engine-bench "${vtests[@]}"
  stage tpserve-engine-bench "tpserve-engine-bench-$v"
  for t in "${vtests[@]}"; do stage "$t" "${t%_test}_${v//-/_}_test"; done
  git apply -R "$patch"
  trap - EXIT
done
# The unpatched tree's objects again, so the next build here does not ship a variant's.
[ -z "${TPSERVE_GPU_VARIANTS:-}" ] || ninja -C "$build" -j2 "${targets[@]}" ${TPSERVE_GPU_VARIANT_TESTS:-} >/dev/null
bash "${TPSERVE_BUNDLE_LIBS:-../shared/tools/bundle-libs.sh}" "$dest/lib" "$dest"/bin/*
# The carried tree is limited (64 MiB): ship the big files xz-compressed; tools/gpu_unpack.sh
# (called by gpu_job.sh) unpacks. The binaries go as one archive: they share most of their code
# (the kernels, gRPC), and xz -9's 64 MiB window finds it again across files (2026-12-07: eight
# stripped binaries in 28.4 MB, against ~85 MB compressed one by one).
tar cf - -C "$dest/bin" . | xz -T1 -9 >"$dest/bins.tar.xz"
rm -rf "$dest/bin"
find "$dest/lib" -type f -size +100k -exec xz -T2 -6 {} +
du -sh "$dest"
