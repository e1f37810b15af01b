"""The results folder's layout: one file per (hardware, workload), `<date>-<hardware>-<workload>.json` and `.md`,
holding the newest result of that workload on that hardware; a newer run replaces the file of an older one.

A file is one run's document with only that workload's rows: {"meta", "ceilings", "rows"}, the meta naming the
workload ("workload") and the label the run was given ("tag"); its date is that run's start. A run measures
units (for the harness: a model's row of a workload, e.g. qwen2.5-0.5b "W3 local"); where the newest run did not
measure a unit that an earlier one did (another model, a part cut by the time budget), the newest earlier run
that did keeps that unit's rows under "earlier_runs" ({"meta", "ceilings", "rows"} each), so a figure leaves
the folder only when a newer run measured it again. Every row stays beside the peers of its own run: ratios
never mix runs. The harness (report.write_report) and the side benchmarks (service_bench.write_results) save
through save_newest; `python -m benchmarks.harness.file_results FILE...` files result files made elsewhere (a
GPU host's $OUT) the same way.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from typing import Callable, Iterable

Unit = Callable[[dict], object]          # what a row measures: a newer run's row replaces an older one's of the same unit
Render = Callable[[dict], str]           # one run ({"meta", "ceilings", "rows"}) as markdown
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


RESULTS_DIR = "benchmarks/results"


def results_dir(out: str | None, quick: bool) -> str:
    """Where a run writes: --out, else the results folder; a smoke run (--quick) without --out goes to a fresh
    temporary folder, since its figures are not results and would replace real ones."""
    if out:
        return out
    if quick:
        out = tempfile.mkdtemp(prefix="bench-quick-")
        print(f"--quick without --out: results go to {out}")
        return out
    return RESULTS_DIR


def slug(text: str, limit: int = 40) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:limit] or "unknown"


def hardware_slug(hardware: str) -> str:
    return slug(hardware)


def result_name(meta: dict, workload: str) -> str:
    """<date>-<hardware>-<workload>: the stem of the file of `workload` whose newest run has `meta`."""
    return f"{meta['started_utc'][:10]}-{hardware_slug(meta['hardware'])}-{slug(workload)}"


def harness_workload(row: dict) -> str:
    """The harness workload a row belongs to: the first word of its name ("W3 local" -> W3, "WBI W2" -> WBI)."""
    return row["workload"].split(" ", 1)[0]


def harness_unit(row: dict) -> tuple[str, str]:
    return row.get("model", "?"), row.get("workload", "?")


def runs_of(doc: dict) -> list[dict]:
    """The runs of a result file, newest first: its own, then its earlier_runs."""
    top = {"meta": doc.get("meta", {}), "ceilings": doc.get("ceilings"), "rows": doc.get("rows", [])}
    return [top, *doc.get("earlier_runs", [])]


def has_figure(row: dict) -> bool:
    """A harness row with the engine's value (a side benchmark's rows have no engine cell: each is a figure)."""
    return "engine" not in row or (row.get("engine") or {}).get("value") is not None


def _started(run: dict) -> str:
    return run["meta"].get("started_utc", "")


def merge(docs: Iterable[dict], unit: Unit) -> dict:
    """One file's document from the runs of `docs` (a later doc's copy of the same run wins): each unit's rows
    from the newest run that has a figure for it; a unit no run has a figure for (n/a: skipped, cut by the
    budget, failed) from the newest of those runs that has its rows, or from the newest run when no run has a
    figure; the other runs drop out."""
    by_start: dict[str, dict] = {}
    for doc in docs:
        for run in runs_of(doc):
            by_start[_started(run)] = run
    runs = sorted(by_start.values(), key=_started, reverse=True)
    owner: dict[object, int] = {}
    for i, run in enumerate(runs):
        for row in run["rows"]:
            if has_figure(row):
                owner.setdefault(unit(row), i)
    for i in sorted(set(owner.values()) or {0}):
        for row in runs[i]["rows"]:
            owner.setdefault(unit(row), i)
    out = [{**run, "rows": [r for r in run["rows"] if owner.get(unit(r)) == i]} for i, run in enumerate(runs)]
    top, *earlier = [run for run in out if run["rows"]] or runs[:1]
    doc = {"meta": top["meta"], "ceilings": top.get("ceilings"), "rows": top["rows"]}
    if earlier:
        doc["earlier_runs"] = earlier
    return doc


def render_file(doc: dict, render: Render) -> str:
    """The markdown of a result file: its run, then each earlier run (headings two levels down)."""
    text = render(runs_of(doc)[0])
    earlier = doc.get("earlier_runs", [])
    if earlier:
        text += ("\n## Earlier runs\n\nWhat the run above did not measure, from the newest run that did (each "
                 "row's ratios are to the peers of its own run):\n\n")
        text += "\n".join(re.sub(r"(?m)^#", "###", render(run)) for run in earlier)
    return text


def files_of(folder: str, hardware: str, workload: str) -> list[str]:
    """The result files in `folder` of (hardware, workload), by name and by their meta."""
    tail = f"-{hardware_slug(hardware)}-{slug(workload)}.json"
    out = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.endswith(tail) and DATE.match(name[:-len(tail)]):
            meta = read(os.path.join(folder, name)).get("meta", {})
            if meta.get("hardware") == hardware and meta.get("workload") == workload:
                out.append(os.path.join(folder, name))
    return out


def read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def save_newest(folder: str, workload: str, run: dict, unit: Unit, render: Render) -> str:
    """File one run's rows of `workload` ({"meta", "ceilings", "rows"}) in `folder`, merged with the file of the
    same hardware and workload there (merge()), under the name of the newest run kept; the older file goes.
    Returns the JSON path (its .md beside it); a file left as it was is not rewritten."""
    meta = {**run["meta"], "workload": workload}
    new = json.loads(json.dumps({"meta": meta, "ceilings": run.get("ceilings"), "rows": run["rows"]}, default=str))
    old = files_of(folder, meta["hardware"], workload)
    docs = [read(p) for p in old]
    doc = merge([*docs, new], unit)
    stem = os.path.join(folder, result_name(doc["meta"], workload))
    if [stem + ".json"] == old and docs[0] == doc:
        return stem + ".json"
    os.makedirs(folder, exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(doc, f, indent=1, default=str)
    with open(stem + ".md", "w") as f:
        f.write(render_file(doc, render))
    for path in old:
        if path != stem + ".json":
            for p in (path, path[:-5] + ".md"):
                if os.path.exists(p):
                    os.remove(p)
            print(f"replaced {os.path.basename(path)}")
    return stem + ".json"
