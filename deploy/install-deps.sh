#!/usr/bin/env bash
# Installs every Debian package tpserve's build, tests and tools need, skipping what is present.
# Runs as root, or through sudo. CUDA (nvcc, cuBLAS, NCCL) is not a Debian package here: when
# /usr/local/cuda/bin/nvcc exists the CUDA kernels are built too, otherwise they are skipped.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git clang-format
  libabsl-dev libprotobuf-dev protobuf-compiler libgrpc++-dev protobuf-compiler-grpc libssl-dev
  libopenmpi-dev openmpi-bin
  libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libpcre2-dev libutf8proc-dev libopenblas-dev
  libcpp-httplib-dev curl prometheus openssl
  python3 python3-grpcio python3-grpc-tools python3-protobuf python3-numpy python3-matplotlib
  # clang with libFuzzer builds the chat-template fuzzer that ctest runs (tests/coordinator).
  clang-14 libclang-rt-14-dev
)
# Node.js and npm run the tokenizer conformance references and the openai SDK test of the HTTP
# API; any install that provides the
# commands will do (Debian's packages, or a Node.js build that bundles npm).
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  packages+=(nodejs npm)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: need root or sudo" >&2; exit 1; }
  sudo_cmd=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -q
"${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
