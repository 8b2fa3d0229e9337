#!/usr/bin/env bash
# Makes a mesh CA, certificates and a client token with OpenSSL, for the demo,
# the tests and a first deployment (rotate them for production: see
# docs/security.md). Idempotent: files already there are kept.
#
#   tools/make_certs.sh DIR [--hosts 'shardgemm-coordinator,*.shardgemm-workers'] [--days 365]
#
# DIR gets:
#   ca.crt ca.key                  the mesh CA (keep ca.key off the servers)
#   coordinator.crt/.key           CN shardgemm-coordinator: serves clients and workers,
#                                  and calls the workers (mutual TLS)
#   worker.crt/.key                CN shardgemm-worker: serves the coordinator, calls it
#   client.crt/.key                CN shardgemm-client: an optional client certificate
#   client.token                   a bearer token for tenant "demo" (the client's secret)
#   tokens                         what the coordinator reads: the token's SHA-256 and tenant
# Every certificate names localhost, 127.0.0.1 and ::1 and the --hosts.
set -euo pipefail
DIR=${1:?usage: tools/make_certs.sh DIR [--hosts H1,H2] [--days N]}
shift
HOSTS="" DAYS=365
while (($#)); do
  case $1 in
    --hosts) HOSTS=$2; shift 2 ;;
    --days) DAYS=$2; shift 2 ;;
    *) echo "make_certs: unknown argument $1" >&2; exit 2 ;;
  esac
done
command -v openssl >/dev/null || { echo "make_certs: openssl is not installed" >&2; exit 1; }
mkdir -p "$DIR"
chmod 700 "$DIR"
cd "$DIR"

san="DNS:localhost,IP:127.0.0.1,IP:::1"
IFS=',' read -ra extra <<<"$HOSTS"
for h in "${extra[@]}"; do
  [[ -z $h ]] && continue
  if [[ $h =~ ^[0-9.]+$ || $h == *:* ]]; then san+=",IP:$h"; else san+=",DNS:$h"; fi
done

if [[ ! -s ca.crt || ! -s ca.key ]]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout ca.key -out ca.crt \
    -days "$DAYS" -subj "/O=shardgemm/CN=shardgemm mesh CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
fi

issue() {  # name CN extendedKeyUsage
  local name=$1 cn=$2 eku=$3
  [[ -s $name.crt && -s $name.key ]] && return
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$name.key" -out "$name.csr" \
    -subj "/O=shardgemm/CN=$cn" 2>/dev/null
  printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=%s\nsubjectAltName=%s\n' \
    "$eku" "$san" >"$name.ext"
  openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -out "$name.crt" \
    -days "$DAYS" -extfile "$name.ext" 2>/dev/null
  rm -f "$name.csr" "$name.ext"
}
issue coordinator shardgemm-coordinator serverAuth,clientAuth
issue worker shardgemm-worker serverAuth,clientAuth
issue client shardgemm-client clientAuth
chmod 600 ./*.key

if [[ ! -s client.token ]]; then
  (umask 077; openssl rand -hex 32 >client.token)
fi
if [[ ! -s tokens ]]; then
  hash=$(tr -d '\n' <client.token | openssl dgst -sha256 -r | cut -d' ' -f1)
  (umask 077; printf '# sha256 of the bearer token, the tenant it acts for\nsha256:%s demo\n' "$hash" >tokens)
fi
echo "make_certs: $PWD (CA, coordinator, worker, client certificates; token for tenant demo)" >&2
