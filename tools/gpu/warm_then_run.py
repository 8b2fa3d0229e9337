#!/usr/bin/env python3
"""Brings the GPU to its working clocks, then runs a Python script in this
process (no idle gap for the clocks to drop in). An idle H200 sits at 345 MHz
and ramps up over the first calls; our bench warms itself by tuning every
shape before it times anything, so the peer scripts run through this.

  python3 warm_then_run.py SCRIPT [ARGS...]
"""
import runpy
import sys
import time

import torch


def warm(seconds=1.0):
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(8):
            a @ b
        torch.cuda.synchronize()
    del a, b
    torch.cuda.empty_cache()


if __name__ == "__main__":
    warm()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
