#!/usr/bin/env bash
# Does all set-up on a fresh Debian 12 machine, builds tpserve and runs it on the bundled
# tiny-coder model. Usage: bash deploy/run.sh ["prompt text"]
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh >&2
build=${TPSERVE_BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo ${TPSERVE_CMAKE_ARGS:-} >&2
cmake --build "$build" -j "$(nproc)" --target tpserve >&2
prompt=${1:-"def quick_sort(arr):"}
exec "$build/tools/tpserve" run --model models/tiny-coder --prompt "$prompt" --max-new-tokens 64
