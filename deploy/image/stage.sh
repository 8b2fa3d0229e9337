#!/usr/bin/env bash
# Runs in the image's build stage: installs the binaries into STAGE/usr/local/bin
# and copies beside them every shared library they load (ldd) that the runtime
# base does not already hold at the same version (the base's packages were
# recorded in /base-packages.txt before anything was installed), at its
# canonical path (so that COPY --from=... STAGE/ / leaves /lib -> usr/lib
# alone). Library folders outside the loader's defaults are named in
# STAGE/etc/ld.so.conf.d/shardgemm.conf for the runtime stage's ldconfig.
#   stage.sh STAGE SOURCE:NAME...
set -euo pipefail
stage=$1
shift
BASE_LIST=${BASE_LIST:-/base-packages.txt}
mkdir -p "$stage/usr/local/bin"
for spec in "$@"; do
  install -m 755 "${spec%%:*}" "$stage/usr/local/bin/${spec#*:}"
done

# The package (as dpkg names it) that ships a path, trying /lib <-> /usr/lib.
owner() {
  local p out
  for p in "$1" "${1#/usr}" "/usr$1"; do
    if out=$(dpkg-query -S "$p" 2>/dev/null); then
      echo "${out%%: /*}"
      return 0
    fi
  done
  return 1
}

ldd_out=$(for f in "$stage"/usr/local/bin/*; do ldd "$f"; done)
if grep -q "not found" <<<"$ldd_out"; then
  echo "stage.sh: unresolved libraries:" >&2
  grep "not found" <<<"$ldd_out" | sort -u >&2
  exit 1
fi
copied=0 skipped=0
declare -A extra_dirs=()
while read -r lib; do
  [[ -n $lib ]] || continue
  pkg=$(owner "$lib" || owner "$(readlink -f "$lib")" || true)
  if [[ -n $pkg ]] && grep -qxF "$pkg $(dpkg-query -W -f='${Version}' "$pkg")" "$BASE_LIST"; then
    skipped=$((skipped + 1))
    continue
  fi
  dir=$(readlink -f "$(dirname "$lib")")
  mkdir -p "$stage$dir"
  cp -L "$lib" "$stage$dir/$(basename "$lib")"
  copied=$((copied + 1))
  case $dir in
    /usr/lib | /usr/lib/x86_64-linux-gnu | /usr/local/lib) ;;
    *) extra_dirs[$dir]=1 ;;
  esac
done < <(awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' <<<"$ldd_out" | sort -u)
if ((${#extra_dirs[@]})); then
  mkdir -p "$stage/etc/ld.so.conf.d"
  printf '%s\n' "${!extra_dirs[@]}" | sort >"$stage/etc/ld.so.conf.d/shardgemm.conf"
fi
echo "stage.sh: $# binaries, $copied libraries copied, $skipped already in the base; $(du -sh "$stage" | cut -f1) staged"
