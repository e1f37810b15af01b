"""WS, speculation's benchmark (benchmarks/harness/speculative_bench.py), end to end on the embedded model (--quick):
every batch and pass has a row per drafter, on and off gave the same tokens (fp32 CPU), a drafter named with
its dry steps runs with them, and the modes' engines take each wave in turn."""
from __future__ import annotations

import json

from benchmarks.harness import speculative_bench
from benchmarks.harness.result_files import merge
from rollout_service.engine.drafter import DIST_TOP


def test_a_quick_run_compares_every_drafter_on_the_same_tokens(tmp_path, monkeypatch):
    made, order, tops = [], [], []
    engine = speculative_bench._engine

    def noted(make_engine, batch, drafter):
        eng = engine(make_engine, batch, drafter)
        made.append((drafter, None if eng.speculator is None else eng.speculator.dry_steps))
        if drafter is not None:
            tops.append((drafter, eng.speculator.dist_top))
        run = eng.run_until_done
        eng.run_until_done = lambda: order.append(drafter) or run()
        return eng
    monkeypatch.setattr(speculative_bench, "_engine", noted)
    assert speculative_bench.main(["--quick", "--drafters", "suffix,suffix/dry=8/counts", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-ws-speculative.json")
    rows = json.loads(path.read_text())["rows"]
    batch = [r for r in rows if r["measure"] == "batch"]
    assert {(r["batch"], r["drafter"], r["pass"]) for r in batch} == {
        (b, d, p) for b in (1, 8) for d in ("suffix", "suffix/dry=8/counts") for p in ("cold", "warm")}
    assert all(r["identical"] == 1.0 for r in rows), rows
    # per batch size the three modes' engines (the CPU's own dry steps, 0, and the named 8), then the tail's four
    modes = [(None, None), ("suffix", 0), ("suffix/dry=8/counts", 8)]
    assert made == modes + modes + [(None, None), ("suffix", 0), ("suffix", 0), (None, None)], made
    # each wave (one per pass here: batch 1 and 8, cold and warm) run by every mode in turn; then the tail's, off
    # and on in an order that cancels a linear drift
    assert order == [None, "suffix", "suffix/dry=8/counts"] * 4 + [None, "suffix", "suffix", None], order
    (tail,) = [r for r in rows if r["measure"] == "tail"]
    assert tail["runs"] == 2 and tail["identical"] == 1.0 and tail["off_s"] > 0 and tail["on_s"] > 0
    # the engine's drafter learns the drawn distributions; "/counts" counts followers alone
    assert set(tops) == {("suffix", DIST_TOP), ("suffix/dry=8/counts", 0)}, tops


def test_a_run_of_some_batch_sizes_keeps_the_other_batch_sizes_figures():
    """A result file keeps per (model, batch, drafter, pass) the newest run's row: a run of batch 1 alone leaves
    an earlier run's batch 8 and tail in the file, under that run's own heading."""
    def run(started, batches, drafter):
        rows = [{"measure": "batch", "batch": b, "drafter": drafter, "pass": "cold", "speedup": 1.0 + b / 100,
                 "model": "m"} for b in batches]
        return {"meta": {"started_utc": started}, "ceilings": None,
                "rows": rows + ([{"measure": "tail", "speedup": 1.1, "model": "m"}] if len(batches) > 1 else [])}
    doc = merge([run("2026-12-07T21:19:17Z", (1, 8), "suffix"), run("2026-12-07T23:13:24Z", (1,), "suffix")],
                speculative_bench.measured_by)
    assert [(r["measure"], r.get("batch")) for r in doc["rows"]] == [("batch", 1)]
    assert doc["meta"]["started_utc"].startswith("2026-12-07T23")
    (earlier,) = doc["earlier_runs"]
    assert [(r["measure"], r.get("batch")) for r in earlier["rows"]] == [("batch", 8), ("tail", None)]


def test_waves_of_a_batch_size_take_new_prompts_with_the_same_seeds_rule():
    """--waves W: W waves of B / n prompts, each wave on new prompts; the first wave is the run of one wave."""
    one = speculative_bench._batch_requests(16, speculative_bench.Shape(), 0, "cold")
    three = speculative_bench._batch_requests(16, speculative_bench.Shape(waves=3), 0, "cold")
    assert [len(w) for w in three] == [2, 2, 2] and all(r.sampling.n == 8 for w in three for r in w)
    assert [(r.request_id, r.prompt, r.sampling.seed) for r in three[0]] == \
           [(r.request_id, r.prompt, r.sampling.seed) for r in one[0]]
    prompts = [str(r.prompt) for w in three for r in w]
    assert len(set(prompts)) == 6 and len({r.request_id for w in three for r in w}) == 6
