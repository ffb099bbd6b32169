#!/usr/bin/env bash
# tpserve across hosts with mpirun (MPMD): one coordinator and N workers in one MPI job. The
# workers get their ranks and NCCL ids from MPI; the coordinator takes part in MPI_Init and the
# split that separates it from the workers.
#   deploy/mpirun-mpmd.sh MODEL_DIR TP PP [HOSTFILE]
# e.g. 2 hosts x 8 GPUs, TP=8 inside a host, PP=2 across:
#   deploy/mpirun-mpmd.sh /models/deepseek-coder-33b 8 2 hosts.txt
# hosts.txt (Open MPI): the coordinator's host first, with one extra slot:
#   gpu-node-0 slots=9
#   gpu-node-1 slots=8
# The workers prove a shared secret to the coordinator: TPSERVE_CLUSTER_SECRET_FILE names a file
# readable on every host (default ~/.tpserve/cluster-secret on a shared home; made here if absent,
# mode 600). The workers' control plane listens on TPSERVE_CONTROL_PORT (default 50052).
set -euo pipefail
model=${1:?model dir}; tp=${2:-1}; pp=${3:-1}; hostfile=${4:-}
bin=${TPSERVE_BIN:-build}
port=${TPSERVE_PORT:-50051}
control_port=${TPSERVE_CONTROL_PORT:-50052}
secret=${TPSERVE_CLUSTER_SECRET_FILE:-$HOME/.tpserve/cluster-secret}
if [[ ! -s "$secret" ]]; then
  (umask 077 && mkdir -p "$(dirname "$secret")" && head -c 32 /dev/urandom | base64 > "$secret")
fi
coordinator_host=${TPSERVE_COORDINATOR_HOST:-$(hostname)}
n=$((tp * pp))
hosts=()
[[ -n "$hostfile" ]] && hosts=(--hostfile "$hostfile")
exec mpirun --allow-run-as-root "${hosts[@]}" --map-by slot \
  -x OPENBLAS_NUM_THREADS=1 -x NCCL_DEBUG \
  -np 1 "$bin/coordinator/tpserve-coordinator" --model "$model" --port "$port" \
        --control-port "$control_port" --cluster-secret-file "$secret" --workers "$n" --tp "$tp" --pp "$pp" : \
  -np "$n" "$bin/worker/tpserve-worker" --coordinator "$coordinator_host:$control_port" \
        --cluster-secret-file "$secret" --device cuda
