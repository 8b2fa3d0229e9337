#!/usr/bin/env bash
# The service benchmark against a mesh started here: a coordinator and
# WORKERS workers on loopback (the servers from SERVER_BIN, default ./bin),
# then bin/shardgemm-service-bench with the given flags, then shutdown.
#   MESH='dp=2,fsdp=2,ep=2' WORKERS=8 bash tools/service_bench.sh --local=cpu \
#     --presets=tools/bench/cpu_presets.json --lhs_spec='((dp,fsdp,ep),None)' ...
# Prints the bench's table; the servers' logs go to $LOGS (a temp dir).
# COORDINATOR_FLAGS and WORKER_FLAGS add flags to the servers. Plaintext
# (--insecure) unless TLS_DIR names certificates (tools/make_certs.sh): then
# TLS everywhere and the bench sends the token. SERVER_SECURITY, when set
# (even empty), replaces the servers' security flags only (a build older than
# --insecure gets SERVER_SECURITY= ; the bench keeps --insecure).
# COORDINATOR_CPUS, WORKER_CPUS and BENCH_CPUS (taskset -c lists, e.g. 2 or
# 2-3) pin the processes to cores. CLIENT_SOCKET=PATH: the coordinator also
# serves clients on that Unix socket (--client_socket) and the bench calls it
# there (unix:PATH) instead of over loopback TCP; the workers keep TCP. PATH's
# directory must be this user's and writable by no one else (not /tmp itself).
# CALL_SOCKET=PATH: the coordinator also takes GroupedGemm calls as frames on
# that Unix socket (--call_socket) and the bench sends them there
# (--call_socket); its other calls keep the gRPC target. Same directory rule.
set -euo pipefail
cd "$(dirname "$0")/.."
SERVER_BIN=${SERVER_BIN:-./bin}
BENCH=${BENCH:-./bin/shardgemm-service-bench}
PORT=${PORT:-50171}
ADDR=127.0.0.1:$PORT
MESH=${MESH:-dp=1}
WORKERS=${WORKERS:-1}
LOGS=${LOGS:-$(mktemp -d)}
if [[ -n ${TLS_DIR:-} ]]; then SECURITY="--tls_dir=$TLS_DIR"; else SECURITY="--insecure"; fi
SERVER_SECURITY=${SERVER_SECURITY-$SECURITY}
pinned() {  # CPU_LIST COMMAND...: COMMAND on those cores (all when empty), in this process
  local cpus=$1
  shift
  if [[ -n $cpus ]]; then exec taskset -c "$cpus" "$@"; else exec "$@"; fi
}
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
CLIENT_TARGET=$ADDR
SOCKET_FLAGS=()
if [[ -n ${CLIENT_SOCKET:-} ]]; then
  CLIENT_TARGET=unix:$CLIENT_SOCKET
  SOCKET_FLAGS=(--client_socket="$CLIENT_SOCKET")
fi
BENCH_SOCKET_FLAGS=()
if [[ -n ${CALL_SOCKET:-} ]]; then
  SOCKET_FLAGS+=(--call_socket="$CALL_SOCKET")
  BENCH_SOCKET_FLAGS=(--call_socket="$CALL_SOCKET")
fi
pinned "${COORDINATOR_CPUS:-}" "$SERVER_BIN/shardgemm-coordinator" --listen="$ADDR" --mesh="$MESH" ${SOCKET_FLAGS[@]+"${SOCKET_FLAGS[@]}"} $SERVER_SECURITY ${COORDINATOR_FLAGS:-} 2>"$LOGS/coordinator.log" &
pids+=($!)
for ((i = 0; i < WORKERS; i++)); do
  pinned "${WORKER_CPUS:-}" "$SERVER_BIN/shardgemm-worker" --coordinator="$ADDR" $SERVER_SECURITY ${WORKER_FLAGS:-} 2>"$LOGS/worker$i.log" &
  pids+=($!)
done
(pinned "${BENCH_CPUS:-}" "$BENCH" --coordinator="$CLIENT_TARGET" $SECURITY ${BENCH_SOCKET_FLAGS[@]+"${BENCH_SOCKET_FLAGS[@]}"} "$@")
