#!/usr/bin/env bash
# Makes the base image localhost/shardgemm-base:bookworm (both stages of
# deploy/image/Dockerfile start from it) when it is missing: no registry is
# needed. `debootstrap --variant=minbase bookworm` from the Debian mirror this
# host uses (/etc/apt/sources.list.d/debian.sources), that file's suites as the
# image's apt sources (updates and security included), the upgrades applied,
# docs/man pages/locales left out of later installs (as Debian's slim images
# do), apt's lists and caches removed; then `podman import`.
# Idempotent: an existing image is kept (SHARDGEMM_BASE_REBUILD=1 remakes it).
set -euo pipefail
IMAGE=${1:-${SHARDGEMM_BASE_IMAGE:-localhost/shardgemm-base:bookworm}}
SUITE=bookworm
SOURCES=/etc/apt/sources.list.d/debian.sources

if [[ ${SHARDGEMM_BASE_REBUILD:-0} != 1 ]] && podman image exists "$IMAGE"; then
  echo "make_base: $IMAGE exists"
  exit 0
fi
MIRROR=http://deb.debian.org/debian
if [[ -r $SOURCES ]]; then
  first=$(awk '/^URIs:/ {print $2; exit}' "$SOURCES")
  [[ -n $first ]] && MIRROR=$first
fi

dir=$(mktemp -d /var/tmp/shardgemm-base.XXXXXX)
chmod 755 "$dir"  # apt's _apt user reads its downloads there
cleanup() {
  umount "$dir/proc" 2>/dev/null || true
  rm -rf --one-file-system "$dir"
}
trap cleanup EXIT

echo "make_base: debootstrap --variant=minbase $SUITE from $MIRROR"
start=$SECONDS
debootstrap --variant=minbase "$SUITE" "$dir" "$MIRROR" >"$dir.log" 2>&1 || {
  tail -20 "$dir.log" >&2; rm -f "$dir.log"; exit 1; }
rm -f "$dir.log"

cat >"$dir/etc/dpkg/dpkg.cfg.d/docker-slim" <<'CFG'
# As Debian's slim images: no docs, man pages or translations from later installs.
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/lintian/*
CFG
cat >"$dir/etc/apt/apt.conf.d/90shardgemm-no-recommends" <<'CFG'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
CFG
if [[ -r $SOURCES ]]; then
  cp "$SOURCES" "$dir/etc/apt/sources.list.d/debian.sources"
  rm -f "$dir/etc/apt/sources.list"
fi

mount -t proc proc "$dir/proc"
chroot "$dir" /usr/bin/env DEBIAN_FRONTEND=noninteractive sh -c \
  'apt-get update -qq && apt-get -y -qq upgrade && apt-get clean' >"$dir.log" 2>&1 || {
  tail -20 "$dir.log" >&2; rm -f "$dir.log"; exit 1; }
rm -f "$dir.log"
umount "$dir/proc"
rm -rf "$dir"/var/lib/apt/lists/* "$dir"/var/cache/apt/*.bin "$dir"/var/log/*.log "$dir"/tmp/* \
  "$dir"/usr/share/doc/*/changelog* "$dir"/usr/share/man/* "$dir"/usr/share/info/*
# Postinst scripts (OpenJDK's update-alternatives) link man pages into these.
mkdir -p "$dir"/usr/share/man/man{1..8}
: >"$dir/etc/resolv.conf"
: >"$dir/etc/hostname"

tar --numeric-owner -C "$dir" -c . | podman import -q --change 'CMD ["/bin/bash"]' \
  --message "debootstrap --variant=minbase $SUITE ($MIRROR)" - "$IMAGE" >/dev/null
echo "make_base: $IMAGE made in $((SECONDS - start)) s, $(podman image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"
