"""Benchmark harness: the engine vs HF transformers on fixed workloads, with the hardware floor.

`rollout-service bench --help` (or `python -m benchmarks --help`), or `main(argv)` from Python. Workloads,
models and peers are the ones fixed in benchmarks/README.md; each workload's results go to
benchmarks/results/<date>-<hardware>-<workload>.json and .md, replacing that hardware's older file of the
workload. The command line is read here, before the harness imports torch and transformers (seconds), so
--help and a mistyped option answer at once.
"""
from __future__ import annotations

import argparse

from rollout_service.config import DTYPE_NAMES

from benchmarks.harness.workload_names import WORKLOADS

DTYPES = DTYPE_NAMES


def parse_args(argv: list[str] | None, prog: str | None = None) -> argparse.Namespace:
    """prog: the command's name in usage lines (None: this program's, as argparse finds it)."""
    p = argparse.ArgumentParser(prog=prog, description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--model", default=None,
                   help="comma-separated names from benchmarks/harness/models.py (default: smollm2-135m on "
                        "CPU, qwen2.5-0.5b on GPU, tiny-llama with --quick)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of " + ",".join(sorted(WORKLOADS)))
    p.add_argument("--out", default=None,
                   help="folder of the <date>-<hardware>-<workload>.json and .md files; a workload's older file of "
                        "this hardware there is replaced (benchmarks/harness/result_files.py)")
    p.add_argument("--tag", default="", help="a label of the run, kept in its files' meta (not in their names)")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run of every code path")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=DTYPES, help="default: bf16 (fp32 for smollm2 on CPU)")
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "cuda"], help="engine ops backend")
    p.add_argument("--shape", action="append", default=[], help="override a workload size, e.g. w2_seqs=32")
    p.add_argument("--engine-opt", action="append", default=[], help="extra engine option KEY=VALUE")
    p.add_argument("--skip", action="append", default=[],
                   help="skip a workload or part, optionally per model/workload: W2n, hf_generate_batch, "
                        "llama3-8b:hf_static, W1:hf_generate_batch, llama3-8b:W1:hf_generate_batch")
    p.add_argument("--static-peer", default="auto", choices=["auto", "on", "off"],
                   help="HF static cache + compile peer for W1 (auto: GPU only)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each W1/W2/W2n/W2p measurement, best kept (for a shared machine)")
    p.add_argument("--peer-new-tokens", type=int, default=0,
                   help="HF peers generate at most this many new tokens per sequence and their tok/s or ms/step "
                        "is over those (default 0: as many as the engine); for peers whose steps all cost the same")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for every contender (default: torch's own choice)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="time budget of the whole run, shared out between the models; parts that would start "
                        "after it is spent become n/a")
    args = p.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        p.error(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    return args


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    from benchmarks.harness.harness import run
    return run(args, argv)


__all__ = ["WORKLOADS", "main"]
