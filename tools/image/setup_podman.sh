#!/usr/bin/env bash
# Idempotent setup for the image build and `make image-test`: Debian's podman
# (4.3) with runc, debootstrap (the base image), netavark + aardvark-dns (a
# podman network whose containers find each other by name) and iptables (its
# port publishing). Then /etc/containers/containers.conf gets the settings
# these hosts need, keeping whatever else it holds:
#   [containers] default_ulimits = []   (otherwise runc fails on RLIMIT_NOFILE)
#   [engine] cgroup_manager = "cgroupfs", events_logger = "file", runtime = "runc"
#            (no systemd here; crun fails on these hosts' hybrid cgroups)
#   [network] network_backend = "netavark"
# Safe to run every time; does nothing when all is in place. Exits 1 (with the
# reason) when podman cannot run a container here.
set -euo pipefail

APT_PACKAGES=(podman runc conmon netavark aardvark-dns iptables debootstrap catatonit)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
if ((${#missing[@]})); then
  echo "setup_podman: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

CONF=${CONTAINERS_CONF_PATH:-/etc/containers/containers.conf}
$SUDO mkdir -p "$(dirname "$CONF")"
$SUDO python3 - "$CONF" <<'PY'
"""Sets keys in a TOML file's sections, line by line, leaving the rest as it is."""
import os, re, sys

path = sys.argv[1]
want = {
    "containers": {"default_ulimits": "[]"},
    "engine": {"cgroup_manager": '"cgroupfs"', "events_logger": '"file"', "runtime": '"runc"'},
    "network": {"network_backend": '"netavark"'},
}
lines = open(path).read().splitlines() if os.path.exists(path) else []
header = re.compile(r"^\s*\[([^\[\]]+)\]\s*(#.*)?$")
for section, keys in want.items():
    start = next((i for i, l in enumerate(lines) if (m := header.match(l)) and m.group(1).strip() == section), None)
    if start is None:
        lines += ["", f"[{section}]"] + [f"{k} = {v}" for k, v in keys.items()]
        continue
    end = next((i for i in range(start + 1, len(lines)) if header.match(lines[i]) or lines[i].lstrip().startswith("[[")), len(lines))
    for k, v in keys.items():
        key = re.compile(rf"^\s*{re.escape(k)}\s*=")
        hit = next((i for i in range(start + 1, end) if key.match(lines[i])), None)
        if hit is None:
            lines.insert(start + 1, f"{k} = {v}")
            end += 1
        else:
            lines[hit] = f"{k} = {v}"
text = "\n".join(lines).lstrip("\n") + "\n"
if not os.path.exists(path) or open(path).read() != text:
    open(path, "w").write(text)
    print(f"setup_podman: wrote {path}")
PY

# A container must start; say why when it cannot.
if ! out=$(podman info --format '{{.Host.OCIRuntime.Name}} {{.Host.CgroupManager}} {{.Store.GraphDriverName}}' 2>&1); then
  echo "setup_podman: podman does not work here: $out" >&2
  exit 1
fi
