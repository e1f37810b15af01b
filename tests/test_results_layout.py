"""benchmarks/results/ keeps the newest result per hardware and workload: one <date>-<hardware>-<workload>.json
(+ .md) each, its rows of that workload only, named after its meta; and the writer the harness and the side
benchmarks save through (benchmarks/harness/result_files.save_newest) keeps it that way."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks.harness.file_results import SIDE
from benchmarks.harness.report import Cell, Row, render_run, write_report
from benchmarks.harness.result_files import (harness_unit, harness_workload, merge, result_name, runs_of,
                                             save_newest)
from benchmarks.harness.workload_names import WORKLOADS

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
SIDE_BENCHES = tuple(SIDE)  # the side benchmarks file_results knows how to file
NAME = re.compile(r"^\d{4}-\d{2}-\d{2}-[a-z0-9]+(-[a-z0-9]+)*\.json$")


def committed() -> list[tuple[Path, dict]]:
    return [(p, json.loads(p.read_text())) for p in sorted(RESULTS.glob("*.json"))]


def problems(path: Path, doc: dict) -> list[str]:
    """What is wrong with one result file of the folder ([] when nothing)."""
    meta, out = doc.get("meta", {}), []
    workload = meta.get("workload")
    if not NAME.match(path.name):
        out.append("not named <date>-<hardware>-<workload>.json")
    if workload not in WORKLOADS and workload not in SIDE_BENCHES:
        return out + [f"meta names no workload the harness or a side benchmark has: {workload!r}"]
    if path.stem != result_name(meta, workload):
        out.append(f"its meta (hardware {meta.get('hardware')!r}, started {meta.get('started_utc')!r}, workload "
                   f"{workload!r}) names it {result_name(meta, workload)}.json")
    runs = runs_of(doc)
    if [r["meta"].get("started_utc") for r in runs] != sorted((r["meta"].get("started_utc") for r in runs), reverse=True):
        out.append("its runs are not newest first: the name's date is not its newest run's")
    for run in runs:
        m = run["meta"]
        if (m.get("hardware"), m.get("workload")) != (meta["hardware"], workload):
            out.append(f"a run of {m.get('started_utc')} is of {m.get('hardware')!r} / {m.get('workload')!r}")
        if not run["rows"]:
            out.append(f"the run of {m.get('started_utc')} has no rows")
        for row in run["rows"]:
            if workload in SIDE_BENCHES:
                if "metric" in row:
                    out.append(f"a harness row ({row.get('workload')!r}) in a {workload} file")
            elif harness_workload(row) != workload:
                out.append(f"a row of {row.get('workload')!r} in a {workload} file")
    if workload in WORKLOADS and merge([doc], harness_unit) != doc:
        out.append("filing it again would change it: a unit kept from an older run than the newest that measured it")
    if not path.with_suffix(".md").exists():
        out.append("no .md beside it")
    return out


def test_every_result_file_is_named_by_date_hardware_and_workload_and_holds_that_workload_only():
    found = {p.name: problems(p, doc) for p, doc in committed()}
    assert len(found) >= 20
    assert not {k: v for k, v in found.items() if v}


def twins(files: list[tuple[Path, dict]]) -> list[str]:
    """Files of a (hardware, workload) that another file has too."""
    seen: dict[tuple[str, str], str] = {}
    out = []
    for path, doc in files:
        key = (doc["meta"].get("hardware"), doc["meta"].get("workload"))
        if key in seen:
            out.append(f"{path.name} and {seen[key]}: two files of {key}")
        seen[key] = path.name
    return out


def test_one_file_per_hardware_and_workload():
    assert twins(committed()) == []
    doc = {"meta": _meta("2026-12-03T10:00:00Z", workload="W2"), "rows": []}
    older = {"meta": _meta("2026-12-01T10:00:00Z", workload="W2"), "rows": []}
    assert twins([(Path("2026-12-01-gpu-w2.json"), older), (Path("2026-12-03-gpu-w2.json"), doc)])


def test_the_checks_catch_a_misnamed_file_a_mixed_file_and_a_name_that_disagrees(tmp_path):
    meta = _meta("2026-12-03T10:00:00Z", workload="W2")
    good = {"meta": meta, "ceilings": None, "rows": [_row("q", "W2", 1.0)]}
    cases = {"2026-12-03-gpu-issue9.json": good,  # a label in the name
             "2026-12-03-gpu-w2.json": {**good, "rows": [_row("q", "W2", 1.0), _row("q", "W1", 2.0)]},
             "2026-12-04-gpu-w2.json": good,  # the date is not the run's
             "2026-12-03-gpu-w1.json": good}  # nor the workload
    for name, doc in cases.items():
        path = tmp_path / name
        path.write_text(json.dumps(doc))
        path.with_suffix(".md").write_text("")
        assert problems(path, doc), name
    path = tmp_path / "2026-12-03-gpu-w2.json"
    path.write_text(json.dumps(good))
    assert problems(path, good) == []


def _meta(started: str, hardware: str = "GPU", workload: str | None = None) -> dict:
    meta = {"started_utc": started, "hardware": hardware, "device": "cuda", "torch": "t", "transformers": "tf",
            "python": "p", "command": "bench"}
    return {**meta, "workload": workload} if workload else meta


def _row(model: str, workload: str, value: float | None) -> dict:
    cell = Cell(value) if value is not None else Cell.na("skipped: time budget of this run spent")
    return Row(model, workload, "tok/s", "tok/s", True, engine=cell).to_dict()


def _save(folder: Path, started: str, rows: list[dict], workload: str = "W2", hardware: str = "GPU") -> Path:
    run = {"meta": _meta(started, hardware), "ceilings": None, "rows": rows}
    return Path(save_newest(str(folder), workload, run, harness_unit, render_run))


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_newer_run_replaces_the_older_file_of_its_hardware_and_workload(tmp_path):
    _save(tmp_path, "2026-12-01T10:00:00Z", [_row("q", "W2", 100.0)])
    _save(tmp_path, "2026-12-01T09:00:00Z", [_row("q", "W2", 1.0)], hardware="CPU")  # another machine: stays
    path = _save(tmp_path, "2026-12-03T10:00:00Z", [_row("q", "W2", 120.0)])
    assert _files(tmp_path) == ["2026-12-01-cpu-w2.json", "2026-12-01-cpu-w2.md", "2026-12-03-gpu-w2.json",
                                "2026-12-03-gpu-w2.md"]
    doc = json.loads(path.read_text())
    assert doc["meta"]["workload"] == "W2" and [r["engine"]["value"] for r in doc["rows"]] == [120.0]
    assert "earlier_runs" not in doc and "| q | W2 |" in path.with_suffix(".md").read_text()


def test_an_older_run_does_not_replace_a_newer_file(tmp_path):
    _save(tmp_path, "2026-12-03T10:00:00Z", [_row("q", "W2", 120.0)])
    path = _save(tmp_path, "2026-12-01T10:00:00Z", [_row("q", "W2", 100.0)])
    assert path.name == "2026-12-03-gpu-w2.json" and _files(tmp_path) == ["2026-12-03-gpu-w2.json",
                                                                          "2026-12-03-gpu-w2.md"]
    doc = json.loads(path.read_text())
    assert [r["engine"]["value"] for r in doc["rows"]] == [120.0] and "earlier_runs" not in doc


def test_what_the_newer_run_did_not_measure_stays_from_its_own_run(tmp_path):
    _save(tmp_path, "2026-12-01T10:00:00Z", [_row("q", "W2", 100.0), _row("llama", "W2", 20.0)])
    # the newer run measured q only; its llama row is n/a (the budget ran out): llama's figure stays
    path = _save(tmp_path, "2026-12-03T10:00:00Z", [_row("q", "W2", 120.0), _row("llama", "W2", None)])
    doc = json.loads(path.read_text())
    assert [(r["model"], r["engine"]["value"]) for r in doc["rows"]] == [("q", 120.0)]
    (earlier,) = doc["earlier_runs"]
    assert earlier["meta"]["started_utc"] == "2026-12-01T10:00:00Z"
    assert [(r["model"], r["engine"]["value"]) for r in earlier["rows"]] == [("llama", 20.0)]
    md = path.with_suffix(".md").read_text()
    assert "## Earlier runs" in md and "### Benchmark 2026-12-01T10:00:00Z on GPU" in md
    assert merge([doc], harness_unit) == doc  # filing the file again changes nothing
    # a run measuring llama again leaves nothing of the first run
    doc = json.loads(_save(tmp_path, "2026-12-04T10:00:00Z", [_row("llama", "W2", 22.0)]).read_text())
    assert [r["meta"]["started_utc"] for r in runs_of(doc)] == ["2026-12-04T10:00:00Z", "2026-12-03T10:00:00Z"]
    assert len(list(tmp_path.glob("*.json"))) == 1


def test_the_harness_writes_one_file_per_workload(tmp_path):
    meta = _meta("2026-12-05T10:00:00Z")
    rows = [Row("q", w, "m", "ms", False, engine=Cell(1.0)) for w in ("W2", "W3 local", "W3 object_store", "WBI W2")]
    paths = write_report(str(tmp_path), meta, None, rows)
    assert sorted(Path(p).name for p in paths) == ["2026-12-05-gpu-w2.json", "2026-12-05-gpu-w3.json",
                                                    "2026-12-05-gpu-wbi.json"]
    w3 = json.loads((tmp_path / "2026-12-05-gpu-w3.json").read_text())
    assert [r["workload"] for r in w3["rows"]] == ["W3 local", "W3 object_store"]
    for p in paths:
        assert problems(Path(p), json.loads(Path(p).read_text())) == []
    assert "workload" not in meta  # the run's own meta is not changed


@pytest.mark.parametrize("order", [1, -1])
def test_filing_results_made_elsewhere_merges_them_either_way_round(tmp_path, order):
    from benchmarks.harness.file_results import file_results

    old = {"meta": _meta("2026-12-01T10:00:00Z"), "ceilings": None,
           "rows": [_row("q", "W2", 100.0), _row("llama", "W2", 20.0), _row("q", "W1", 1.0)]}
    new = {"meta": _meta("2026-12-03T10:00:00Z", workload="W2"), "ceilings": None, "rows": [_row("q", "W2", 120.0)]}
    paths = file_results(str(tmp_path), [old, new][::order])
    assert [Path(p).name for p in paths] == ["2026-12-01-gpu-w1.json", "2026-12-03-gpu-w2.json"]
    doc = json.loads(Path(paths[1]).read_text())
    assert [r["model"] for run in runs_of(doc) for r in run["rows"]] == ["q", "llama"]
