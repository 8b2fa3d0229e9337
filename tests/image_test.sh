#!/usr/bin/env bash
# `make image-test`: the CPU image as a mesh of containers on one host. A podman
# network; a coordinator (mesh ep=2,fsdp=2) and 4 CPU workers as containers on
# it, reaching each other by container name; the coordinator's port published
# on 127.0.0.1 only. From the host, ./bin/shardgemm (make build) runs the demo's
# request against it (tools/demo.sh: the resident experts and the sharded
# grouped GEMM with --check) and must print "result matches reference"; every
# container must pass `podman healthcheck run`; the image must hold no compiler
# and no Bazel. Containers and the network are removed whatever happens; every
# wait is bounded. TLS on every hop, as tools/demo.sh: a mesh CA and
# certificates naming the containers (tools/make_certs.sh), the coordinator's
# and the workers' material mounted into their containers, the host's CLI with
# the CA and a token; the health checks go to each server's plaintext
# health-only port (--health_listen=0.0.0.0:8080). Ends with "image test:
# passed" (exit 0) or the failure and the containers' logs (exit 1).
# Environment: SHARDGEMM_IMAGE (default localhost/shardgemm:cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${SHARDGEMM_IMAGE:-localhost/shardgemm:cpu}
CLI=./bin/shardgemm
MESH=ep=2,fsdp=2
WORKERS=4
tag=sg-it-$$
NET=$tag-net
COORD=$tag-coordinator
containers=()
logs=$(mktemp -d)
ok=0

fail() {
  echo "image test: FAILED: $*" >&2
  exit 1
}

cleanup() {
  local rc=$?
  if ((!ok)); then
    for c in "${containers[@]}"; do
      echo "--- podman logs $c" >&2
      timeout 20 podman logs --tail 40 "$c" 2>&1 | grep -v 'systemd' >&2 || true
    done
  fi
  for c in "${containers[@]}"; do
    timeout 60 podman rm -f -t 5 "$c" >/dev/null 2>&1 || true
  done
  timeout 60 podman network rm -f "$NET" >/dev/null 2>&1 || true
  rm -rf "$logs"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Polls CMD... every half second until it succeeds, for at most SECONDS s.
wait_for() {
  local seconds=$1 what=$2
  shift 2
  local deadline=$((SECONDS + seconds))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || fail "$what: not within $seconds s"
    sleep 0.5
  done
}

[[ $(id -u) -eq 0 ]] || fail "run as root (rootful podman, as make image builds)"
[[ -x $CLI ]] || fail "$CLI is missing (make build)"
podman image exists "$IMAGE" || fail "no image $IMAGE (make image)"

# Certificates for every container name; each role's files in a folder of
# its own, owned by the image's user (uid 10001), mounted read-only.
workers=()
for ((i = 0; i < WORKERS; i++)); do workers+=("$tag-worker$i"); done
TLS=$logs/tls
bash tools/make_certs.sh "$TLS" --hosts "$(IFS=,; echo "$COORD,${workers[*]}")" --days 2 >/dev/null \
  || fail "tools/make_certs.sh"
mkdir -p "$logs/coordinator-tls" "$logs/worker-tls"
cp "$TLS"/{ca.crt,coordinator.crt,coordinator.key,tokens} "$logs/coordinator-tls/"
cp "$TLS"/{ca.crt,worker.crt,worker.key} "$logs/worker-tls/"
chown -R 10001:10001 "$logs/coordinator-tls" "$logs/worker-tls"
chmod 700 "$logs/coordinator-tls" "$logs/worker-tls"
SECURITY=--tls_dir=$TLS

# Podman 4.3 schedules periodic health checks with systemd timers; with no
# systemd here they are off, and `podman healthcheck run` below runs them.
health_flags=()
[[ -d /run/systemd/system ]] || health_flags=(--health-interval=disable)

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
ADDR=127.0.0.1:$port

echo "== podman network $NET"
timeout 60 podman network create "$NET" >/dev/null

echo "== $COORD: shardgemm-coordinator --listen=0.0.0.0:50051 --mesh=$MESH, published on $ADDR"
containers+=("$COORD")
timeout 120 podman run -d --name "$COORD" --network "$NET" -p "$ADDR:50051" "${health_flags[@]}" \
  -v "$logs/coordinator-tls:/etc/shardgemm/tls:ro" \
  "$IMAGE" shardgemm-coordinator --listen=0.0.0.0:50051 --mesh="$MESH" \
  --tls_dir=/etc/shardgemm/tls --health_listen=0.0.0.0:8080 \
  >/dev/null 2>"$logs/run.err" || { cat "$logs/run.err" >&2; fail "podman run $COORD"; }
wait_for 60 "$COORD healthy" timeout 10 podman healthcheck run "$COORD"

for w in "${workers[@]}"; do
  echo "== $w: shardgemm-worker --coordinator=$COORD:50051 --listen=0.0.0.0:50052 --advertise_host=$w --backend=cpu"
  containers+=("$w")
  timeout 120 podman run -d --name "$w" --network "$NET" "${health_flags[@]}" \
    -v "$logs/worker-tls:/etc/shardgemm/tls:ro" \
    "$IMAGE" shardgemm-worker --coordinator="$COORD:50051" \
    --listen=0.0.0.0:50052 --advertise_host="$w" --backend=cpu \
    --tls_dir=/etc/shardgemm/tls --health_listen=0.0.0.0:8080 \
    >/dev/null 2>"$logs/run.err" || { cat "$logs/run.err" >&2; fail "podman run $w"; }
done

ready() { timeout 10 "$CLI" cluster --coordinator="$ADDR" "$SECURITY" 2>/dev/null | grep -q "(ready)"; }
wait_for 90 "the mesh ready (all $WORKERS workers registered)" ready
timeout 30 "$CLI" cluster --coordinator="$ADDR" "$SECURITY"

echo
echo "== from the host: expert weights resident, 8 experts [8, 256, 128] bf16 over (ep, fsdp)"
timeout 120 "$CLI" put experts --coordinator="$ADDR" "$SECURITY" --data=8x256x128 --dtype=bf16 --seed=7 \
  --spec='(ep, fsdp, None)' || fail "put experts"
echo
echo "== from the host: the sharded grouped GEMM, checked against the reference"
timeout 300 "$CLI" gemm --coordinator="$ADDR" "$SECURITY" --lhs='1024x256@((fsdp, ep), None)' --rhs=resident:experts \
  --group-sizes='100,0,60,96, 30,30,30,30, 256,0,0,0, 1,2,3,200@((fsdp, ep),)' \
  --dtype=bf16 --seed=42 --check | tee "$logs/gemm.out" || fail "gemm"
grep -q "result matches reference" "$logs/gemm.out" || fail 'no "result matches reference"'

echo
echo "== podman healthcheck run"
for c in "${containers[@]}"; do
  status=$(timeout 30 podman healthcheck run "$c" 2>/dev/null) || fail "$c: unhealthy ($status)"
  user=$(timeout 30 podman exec "$c" id -u 2>/dev/null) || fail "$c: podman exec"
  [[ $user != 0 ]] || fail "$c runs as root"
  echo "   $c: ${status:-healthy} (uid $user)"
done

echo
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
echo "== $IMAGE: $(awk -v b="$size" 'BEGIN {printf "%.0f MB", b / 1e6}')"
found=$(timeout 60 podman run --rm "$IMAGE" sh -c 'command -v gcc bazel cc c++ g++ clang java' 2>/dev/null || true)
[[ -z $found ]] || fail "the runtime image holds build tools: $found"
echo "   no compiler and no Bazel in it (command -v gcc bazel cc c++ g++ clang java: none)"

ok=1
echo
echo "image test: passed"
