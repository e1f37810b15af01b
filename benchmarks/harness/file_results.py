"""File result files made elsewhere (a GPU host's $OUT/benchmarks/results, an old layout) into a results folder
the way the harness saves its own runs: every run of each file, in start order, through result_files.save_newest
(the older file of its hardware and workload replaced), then docs/benchmark-results.md written again when the
folder is benchmarks/results.

    python -m benchmarks.harness.file_results FILE.json [FILE.json ...] [--into benchmarks/results]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from benchmarks.harness import (control_plane, draft_ceiling, openai_bench, openai_serve_bench, prefix_routing,
                                rl_semantics, speculative_bench, staleness, summary)
from benchmarks.harness.report import render_run
from benchmarks.harness.result_files import harness_unit, harness_workload, read, runs_of, save_newest
from benchmarks.harness.service_bench import run_markdown, whole_run

# each side benchmark's name (its files' workload) -> (the markdown under its heading, what one row measures)
SIDE = {"control-plane": (control_plane.markdown, control_plane.configuration),
        "prefix-routing": (prefix_routing.markdown, whole_run),
        "draft-ceiling": (draft_ceiling.markdown, whole_run),
        "openai-endpoint": (openai_bench.markdown, whole_run),
        "openai-serve": (openai_serve_bench.markdown, whole_run),
        "rl-semantics": (rl_semantics.markdown, whole_run),
        "ws-speculative": (speculative_bench.markdown, speculative_bench.measured_by),
        "ws-speculative-invariant": (speculative_bench.markdown, speculative_bench.measured_by),
        "staleness": (staleness.markdown, whole_run)}


def file_run(folder: str, run: dict) -> list[str]:
    """Save one run ({"meta", "ceilings", "rows"}) into `folder`: a harness run's rows workload by workload, a
    side benchmark's under the workload its meta names. Returns the JSON paths."""
    rows = run["rows"]
    if rows and all("metric" in r for r in rows):
        by_workload: dict[str, list[dict]] = {}
        for r in rows:
            by_workload.setdefault(harness_workload(r), []).append(r)
        return [save_newest(folder, wl, {**run, "rows": wl_rows}, harness_unit, render_run)
                for wl, wl_rows in by_workload.items()]
    bench = run["meta"].get("workload")
    if bench not in SIDE:
        raise ValueError(f"a run of {run['meta'].get('started_utc')} with rows of no harness workload and no side "
                         f"benchmark named in its meta (workload: {bench!r}; known: {', '.join(SIDE)})")
    body, unit = SIDE[bench]
    return [save_newest(folder, bench, run, unit, lambda r: run_markdown(r, body))]


def file_results(folder: str, docs: list[dict]) -> list[str]:
    """Every run of `docs`, oldest first, into `folder`; the JSON paths written or kept."""
    runs = sorted((run for doc in docs for run in runs_of(doc)), key=lambda r: r["meta"].get("started_utc", ""))
    written = {p for run in runs for p in file_run(folder, run)}
    return sorted(p for p in written if os.path.exists(p))  # (a later run may have replaced an earlier one's file)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.harness.file_results",
                                description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("files", nargs="+", type=Path, help="result JSON files")
    p.add_argument("--into", type=Path, default=summary.RESULTS, help="the results folder (default: benchmarks/results)")
    args = p.parse_args(argv)
    paths = file_results(str(args.into), [read(str(f)) for f in args.files])
    print("in " + str(args.into) + ": " + ", ".join(Path(x).name for x in paths))
    if args.into.resolve() == summary.RESULTS.resolve():
        summary.main([])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
