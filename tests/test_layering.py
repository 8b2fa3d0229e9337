"""The folders' dependencies point one way (docs/architecture.md, "Layers"):
kernels and the shared vocabulary at the bottom, the planner and the proto
codecs above them, coordinator (server/), worker/ and client/ on top, each
reaching the others only through the proto. Checked on includes and on
Bazel labels, so a shortcut across the top shows up here."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# folder -> the top-level folders it must not reach
FORBIDDEN = {
    "client": {"server", "worker"},
    "server": {"worker", "client"},
    "worker": {"server", "client"},
    "planner": {"server", "worker", "client", "proto"},
    "proto": {"server", "worker", "client"},
    "kernels": {"server", "worker", "client", "planner", "proto"},
    # Libraries any process uses: below the servers and the client.
    "metrics": {"server", "worker", "client", "planner", "proto", "security", "logging"},
    "logging": {"server", "worker", "client", "planner", "proto", "security", "metrics"},
    "security": {"server", "worker", "client", "planner", "proto", "metrics", "logging"},
}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
LABEL = re.compile(r'"//([a-z_]+)[/:"]')


def _files(folder, names):
    for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
        for f in files:
            if names(f):
                yield os.path.join(dirpath, f)


def test_no_folder_includes_a_sibling_above_or_beside_it():
    bad, scanned = [], 0
    for folder, forbidden in FORBIDDEN.items():
        for path in _files(folder, lambda f: f.endswith((".h", ".cc", ".cu", ".cuh"))):
            for inc in INCLUDE.findall(open(path, encoding="utf-8", errors="replace").read()):
                scanned += 1
                top = inc.split("/")[0]
                if top in forbidden:
                    bad.append(f"{os.path.relpath(path, ROOT)} includes {inc}")
    assert scanned > 300, f"only {scanned} includes found: the scan is broken"
    assert not bad, "\n".join(bad)


def test_no_build_target_depends_on_a_sibling_above_or_beside_it():
    bad, scanned = [], 0
    for folder, forbidden in FORBIDDEN.items():
        for path in _files(folder, lambda f: f == "BUILD"):
            for top in LABEL.findall(open(path).read()):
                scanned += 1
                if top in forbidden:
                    bad.append(f"{os.path.relpath(path, ROOT)} depends on //{top}")
    assert scanned > 100, f"only {scanned} labels found: the scan is broken"
    assert not bad, "\n".join(bad)
