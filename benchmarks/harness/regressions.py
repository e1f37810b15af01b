"""Each figure of a new harness run against the newest committed result of the same workload, model and hardware:
a warning for every one that got worse by more than a share (10% by default). scripts/gpu_check.sh runs it on
what it just wrote, against the results as they were before (its runs replace files); a drop is a warning to read,
not a failure (a shared machine has noisy minutes). A result file's earlier runs count as committed results, so
only the figures of runs newer than the committed figure are checked.

    python -m benchmarks.harness.regressions NEW.json [NEW2.json ...] --against benchmarks/results
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.harness.result_files import runs_of

THRESHOLD = 0.10


def _figures(doc: dict) -> dict[tuple[str, str, str], tuple[float, bool, str]]:
    """(hardware, model, workload) -> (the engine's value, higher is better, unit) of one run ({"meta", "rows"})."""
    hardware = doc.get("meta", {}).get("hardware", "?")
    out = {}
    for row in doc.get("rows", []):
        value = (row.get("engine") or {}).get("value")
        if isinstance(value, (int, float)) and value > 0:
            out[(hardware, row["model"], row["workload"])] = (float(value), bool(row.get("higher_is_better", True)),
                                                              row.get("unit", ""))
    return out


def _newest(paths: list[Path]) -> tuple[dict, dict]:
    """(key -> (value, higher is better, unit, file name), key -> its run's start) of the newest run of `paths`
    (every run of every file, ordered by its start) that measured each (hardware, model, workload)."""
    newest: dict = {}
    started: dict = {}
    for path in paths:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for run in runs_of(doc):
            start = run["meta"].get("started_utc", "")
            for key, (value, higher, unit) in _figures(run).items():
                if start >= started.get(key, ""):
                    newest[key], started[key] = (value, higher, unit, path.name), start
    return newest, started


def newest_figures(results: Path, exclude: set[Path]) -> dict[tuple[str, str, str], tuple[float, bool, str, str]]:
    """The newest committed value of every (hardware, model, workload) in `results`, with the file it came from."""
    return _newest([p for p in sorted(results.glob("*.json")) if p.resolve() not in exclude])[0]


def regressions(new: dict, committed: dict, threshold: float = THRESHOLD) -> list[str]:
    """One line per figure of `new` worse than its committed value by more than `threshold` (a share)."""
    lines = []
    for key, (value, higher, unit) in sorted(new.items()):
        if key not in committed:
            continue
        old, _, _, source = committed[key]
        worse = (old - value) / old if higher else (value - old) / old  # a share of the old figure
        if worse > threshold:
            hardware, model, workload = key
            lines.append(f"WARNING: {model} {workload} on {hardware}: {value:.4g} {unit}, {worse:.0%} worse than "
                         f"{old:.4g} in {source}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("new", nargs="+", type=Path, help="result JSON files of the run just made")
    ap.add_argument("--against", type=Path, default=Path("benchmarks/results"), help="committed results")
    ap.add_argument("--threshold", type=float, default=THRESHOLD, help="share of a figure (default 0.10)")
    args = ap.parse_args(argv)
    exclude = {p.resolve() for p in args.new}
    committed, committed_start = _newest([p for p in sorted(args.against.glob("*.json")) if p.resolve() not in exclude])
    figures, started = _newest(args.new)
    # a figure of a run no newer than the committed one is that run itself (a new file carries its earlier runs)
    new = {k: v[:3] for k, v in figures.items()
           if not started[k] or not committed_start.get(k) or started[k] > committed_start[k]}
    lines = regressions(new, committed, args.threshold)
    print("\n".join(lines) if lines else f"no figure more than {args.threshold:.0%} worse than its committed value")
    return 0


if __name__ == "__main__":
    sys.exit(main())
