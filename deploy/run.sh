#!/usr/bin/env bash
# Does all set-up on a fresh Debian 12 machine, builds tpserve and starts the service on the
# bundled tiny-coder model: the coordinator on port ${TPSERVE_PORT:-50051} with its workers (one
# per visible GPU, else 2 CPU workers with TP=2). Query it from another shell:
#   build/tools/tpserve generate --server localhost:50051 --prompt "def quick_sort(arr):" --stream
#   build/tools/tpserve info --server localhost:50051
#   build/tools/tpserve health --server localhost:50051
#   curl localhost:8000/v1/completions -H 'Content-Type: application/json' \
#        -d '{"model": "tiny-coder", "prompt": "def quick_sort(arr):", "max_tokens": 64}'
# (OpenAI-compatible HTTP on ${TPSERVE_HTTP_PORT:-8000}, with /health and /metrics.)
# Ctrl-C (SIGINT) or SIGTERM drains and stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh >&2
build=${TPSERVE_BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo ${TPSERVE_CMAKE_ARGS:-} >&2
cmake --build "$build" -j "$(nproc)" --target tpserve tpserve-worker tpserve-coordinator >&2
port=${TPSERVE_PORT:-50051}
http_port=${TPSERVE_HTTP_PORT:-8000}
echo "tpserve: starting on localhost:$port (gRPC) and localhost:$http_port (HTTP); query it with" >&2
echo "  $build/tools/tpserve generate --server localhost:$port --prompt \"def quick_sort(arr):\" --stream" >&2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec "$build/tools/tpserve" serve --model models/tiny-coder --port "$port" --http-port "$http_port" \
  --worker-binary "$build/worker/tpserve-worker"
