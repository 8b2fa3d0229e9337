#!/usr/bin/env python3
"""Where a request's time goes, from the servers' trace lines.

Reads the JSON logs (--log_format=json) of a coordinator run with
--trace_requests and of workers run with --trace_steps, joins each
request's `request_marks` line with its workers' `step_marks` lines by
request id, and puts every mark on the request's own time axis (the
processes share the host's clock). Prints, per mark, its p50 / p90 offset
from the request's arrival in the coordinator's handler, and the p50 of
each gap between consecutive marks, the worker's marks prefixed `wN.`
(the slowest worker's step, by its `executed` mark, when there are several).

  python3 tools/trace_timeline.py --coordinator=LOGS/coordinator.log LOGS/worker0.log ...
  --skip=N drops each log's first N requests (warm-up).
"""
import argparse
import json
import statistics
import sys


def read_lines(path, event):
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                j = json.loads(line)
            except json.JSONDecodeError:
                continue
            if j.get("event") == event:
                out.append(j)
    return out


def marks_of(line):
    """[(label, absolute µs)] in the line's order."""
    start = line["start_unix_us"]
    marks = []
    for k, v in line.items():
        if k.endswith("_us") and k != "start_unix_us":
            marks.append((k[:-3], start + v))
    return start, marks


def pct(values, q):
    values = sorted(values)
    if not values:
        return float("nan")
    i = min(len(values) - 1, max(0, int(round(q * (len(values) - 1)))))
    return values[i]


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("workers", nargs="*")
    args = ap.parse_args(argv)
    requests = [r for r in read_lines(args.coordinator, "request_marks") if r.get("ok")]
    requests = requests[args.skip:]
    steps = {}
    for i, path in enumerate(args.workers):
        for s in read_lines(path, "step_marks"):
            steps.setdefault(s.get("request_id", ""), []).append((i, s))
    if not requests:
        print("no request_marks lines (run the coordinator with --trace_requests --log_format=json)")
        return 1
    order = []  # labels in first-seen order
    offsets = {}
    joined = 0
    for r in requests:
        start, marks = marks_of(r)
        timeline = list(marks)
        worker_steps = steps.get(r.get("request_id", ""), [])
        if worker_steps:
            joined += 1

            def executed(entry):
                _, ms = marks_of(entry[1])
                return max((t for label, t in ms if label == "executed"), default=0)

            w, slowest = max(worker_steps, key=executed)
            w_start, w_marks = marks_of(slowest)
            timeline.append((f"w{w}.arrived", w_start))
            timeline += [(f"w{w}.{label}", t) for label, t in w_marks]
        timeline.sort(key=lambda m: m[1])
        prev = start
        for label, t in timeline:
            if label not in offsets:
                order.append(label)
                offsets[label] = {"at": [], "gap": []}
            offsets[label]["at"].append(t - start)
            offsets[label]["gap"].append(t - prev)
            prev = t
    print(f"{len(requests)} requests, {joined} joined with their workers' steps; µs from the coordinator's handler")
    print(f"{'mark':<28} {'p50 at':>9} {'p90 at':>9} {'p50 gap from the mark before':>30}")
    order.sort(key=lambda label: statistics.median(offsets[label]["at"]))
    for label in order:
        o = offsets[label]
        print(f"{label:<28} {pct(o['at'], 0.5):9.1f} {pct(o['at'], 0.9):9.1f} {pct(o['gap'], 0.5):30.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
