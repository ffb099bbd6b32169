#!/usr/bin/env bash
# One command, one machine: the coordinator spawns its workers (one per visible GPU, else 2 CPU
# workers with TP=2 when the model allows it), then query it with the client subcommands:
#   deploy/serve-local.sh [MODEL_DIR] [PORT]
#   build/tools/tpserve generate --server localhost:50051 --prompt "def fib(n):" --stream
#   build/tools/tpserve info --server localhost:50051
#   build/tools/tpserve health --server localhost:50051
set -euo pipefail
cd "$(dirname "$0")/.."
build=${TPSERVE_BUILD_DIR:-build}
exec "$build/tools/tpserve" serve --model "${1:-models/tiny-coder}" --port "${2:-50051}" \
  --worker-binary "$build/worker/tpserve-worker"
