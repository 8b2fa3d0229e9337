#!/usr/bin/env bash
# Starts a coordinator and one worker per mesh position on this host and
# keeps them running until interrupted (Ctrl-C stops them all).
#
#   deploy/launch_mesh.sh --mesh 'fsdp=2,ep=2' [--listen 0.0.0.0:50051] [--backend auto|cpu|cuda]
#                         [--memory-budget-mb 4096] [--bin ./bin] [--tls-dir DIR | --insecure]
#
# TLS by default: certificates in --tls-dir (default ./.tls, made there by
# tools/make_certs.sh on first run, naming this host's address); clients use
# --tls_dir=DIR (the token is DIR/client.token).
#
# With --backend cuda (or auto on a GPU host) worker i uses GPU i.
set -euo pipefail
MESH=dp=1 LISTEN=127.0.0.1:50051 BACKEND=auto BUDGET=4096 BIN=./bin ROLES="" TLS_DIR=./.tls INSECURE=0
while (($#)); do
  case $1 in
    --mesh) MESH=$2; shift 2 ;;
    --roles) ROLES=$2; shift 2 ;;
    --listen) LISTEN=$2; shift 2 ;;
    --backend) BACKEND=$2; shift 2 ;;
    --memory-budget-mb) BUDGET=$2; shift 2 ;;
    --bin) BIN=$2; shift 2 ;;
    --tls-dir) TLS_DIR=$2; shift 2 ;;
    --insecure) INSECURE=1; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
workers=1
IFS=',' read -ra axes <<<"$MESH"
for a in "${axes[@]}"; do workers=$((workers * ${a#*=})); done
host=${LISTEN%:*}
[[ $host == 0.0.0.0 ]] && host=127.0.0.1
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait' EXIT INT TERM
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
if ((INSECURE)); then
  SECURITY=--insecure
else
  bash "$(dirname "$0")/../tools/make_certs.sh" "$TLS_DIR" --hosts "$host"
  SECURITY=--tls_dir=$TLS_DIR
fi
"$BIN/shardgemm-coordinator" --listen="$LISTEN" --mesh="$MESH" ${ROLES:+--roles="$ROLES"} $SECURITY &
pids+=($!)
for ((i = 0; i < workers; i++)); do
  "$BIN/shardgemm-worker" --coordinator="$host:${LISTEN##*:}" --listen="$host:0" \
    --backend="$BACKEND" --device="$i" --memory_budget_mb="$BUDGET" $SECURITY &
  pids+=($!)
done
echo "launched a coordinator on $LISTEN and $workers workers (mesh $MESH); Ctrl-C stops them" >&2
wait
