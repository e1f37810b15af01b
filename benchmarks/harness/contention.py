"""W1c / W2c: W1 and W2 while busy neighbour processes keep the machine's CPUs busy (benchmarks/README.md), the
engine and the HF peers under the same contention in one run; compare with W1 / W2 of the same run for the
quiet figures. A CPU rollout worker shares its node with rewards, environments and other workers by design.
"""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import replace

import torch

from benchmarks.harness.context import BenchContext
from benchmarks.harness.report import Row
from benchmarks.harness.workloads import w1_latency, w2_rollout

NEIGHBOURS = 2


# A bare loop, named so that the harness's own neighbours can be told from other busy processes on the machine.
NEIGHBOUR_CODE = "while True: pass  # rollout_service busy neighbour"


@contextmanager
def busy_neighbours(k: int = NEIGHBOURS):
    """k processes that each keep one CPU busy (a bare Python loop) until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", NEIGHBOUR_CODE]) for _ in range(k)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=10)


def _contended(ctx: BenchContext, runner, base: str) -> list[Row]:
    with busy_neighbours():
        rows = runner(ctx)
        tuned = _hf_on_one_thread(ctx, runner)
    for row, one in zip(rows, tuned):
        row.relabel(base, f"{base}c", f"{NEIGHBOURS} busy neighbour processes on {os.cpu_count()} CPUs")
        row.details["neighbours"] = NEIGHBOURS
        row.details["hf_generate_threads"] = torch.get_num_threads()
        if one.hf_generate.value is not None:
            one.hf_generate.note = "HF generate on 1 thread"
        row.other_peer = one.hf_generate
    return rows


def _hf_on_one_thread(ctx: BenchContext, runner) -> list[Row]:
    """The workload's HF generate again on one thread: HF tuned by hand for a busy machine (on all threads, every
    op's barrier waits for whichever thread is descheduled). The HF generate column keeps torch's count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return runner(replace(ctx, skip=ctx.skip | {"engine", "hf_generate_batch", "hf_static"}))
    finally:
        torch.set_num_threads(before)


def w1_contended(ctx: BenchContext) -> list[Row]:
    return _contended(ctx, w1_latency, "W1")


def w2_contended(ctx: BenchContext) -> list[Row]:
    return _contended(ctx, w2_rollout, "W2")
