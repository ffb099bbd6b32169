#!/usr/bin/env bash
# Unpacks what tools/gpu_stage.sh staged under .carry/gpu (run on the GPU machine, from the
# repository root; tools/gpu_job.sh, serve_check.sh and scaling/one_gpu_job.sh call it): the
# binaries' one archive bins.tar.xz into bin/, then any other xz-compressed file (the libraries).
# Running it again does nothing.
set -euo pipefail
stage=${1:-.carry/gpu}
[ -d "$stage" ] || exit 0
if [ -f "$stage/bins.tar.xz" ]; then
  mkdir -p "$stage/bin"
  tar xJf "$stage/bins.tar.xz" -C "$stage/bin"
  rm -f "$stage/bins.tar.xz"
fi
find "$stage" -name '*.xz' -exec xz -d -T0 {} +
chmod +x "$stage"/bin/* 2>/dev/null || true
