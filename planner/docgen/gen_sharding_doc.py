#!/usr/bin/env python3
"""Regenerates docs/sharding.md: fills {{N}} in sharding.md.tmpl with the
plan text of line N of examples.txt ('|'-separated plan_text_main args).

  bazel --output_base=/tmp/bazel_planner build //planner:plan_text_main
  python3 planner/docgen/gen_sharding_doc.py \
      /tmp/bazel_planner/execroot/shardgemm/bazel-out/k8-fastbuild/bin/planner/plan_text_main
(or bazel-bin/planner/plan_text_main of the default output base)
"""
import os
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.abspath(os.path.join(here, "..", ".."))
binary = sys.argv[1]
text = open(os.path.join(here, "sharding.md.tmpl")).read()
for n, line in enumerate(open(os.path.join(here, "examples.txt")).read().splitlines()):
    args = line.split("|")
    run = subprocess.run([binary] + args, capture_output=True, text=True)
    out = "\n".join(l.rstrip() for l in run.stdout.strip("\n").split("\n"))
    text = text.replace("{{%d}}" % n, out)
assert "{{" not in text
open(os.path.join(root, "docs", "sharding.md"), "w").write(text)
