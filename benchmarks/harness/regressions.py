"""Each figure of a new harness run against the newest committed result of the same workload, model and hardware:
a warning for every one that got worse by more than a share (10% by default). scripts/gpu_check.sh runs it on
what it just wrote; a drop is a warning to read, not a failure (a shared machine has noisy minutes).

    python -m benchmarks.harness.regressions NEW.json [NEW2.json ...] --against benchmarks/results
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

THRESHOLD = 0.10


def _figures(doc: dict) -> dict[tuple[str, str, str], tuple[float, bool, str]]:
    """(hardware, model, workload) -> (the engine's value, higher is better, unit) of one result file."""
    hardware = doc.get("meta", {}).get("hardware", "?")
    out = {}
    for row in doc.get("rows", []):
        value = (row.get("engine") or {}).get("value")
        if isinstance(value, (int, float)) and value > 0:
            out[(hardware, row["model"], row["workload"])] = (float(value), bool(row.get("higher_is_better", True)),
                                                              row.get("unit", ""))
    return out


def newest_figures(results: Path, exclude: set[Path]) -> dict[tuple[str, str, str], tuple[float, bool, str, str]]:
    """The newest committed value of every (hardware, model, workload) in `results` (files named
    <date>-<hardware>[-tag].json: the date orders them), with the file it came from."""
    newest: dict = {}
    for path in sorted(results.glob("*.json")):  # date-first names: later files overwrite earlier ones
        if path.resolve() in exclude:
            continue
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for key, (value, higher, unit) in _figures(doc).items():
            newest[key] = (value, higher, unit, path.name)
    return newest


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
    committed = newest_figures(args.against, {p.resolve() for p in args.new})
    new = {k: v for p in args.new for k, v in _figures(json.loads(p.read_text())).items()}
    lines = regressions(new, committed, args.threshold)
    print("\n".join(lines) if lines else f"no figure more than {args.threshold:.0%} worse than its committed value")
    return 0


if __name__ == "__main__":
    sys.exit(main())
