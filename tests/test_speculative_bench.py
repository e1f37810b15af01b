"""WS, speculation's benchmark (benchmarks/harness/speculative_bench.py), end to end on the embedded model (--quick):
every batch and pass has a row per drafter, on and off gave the same tokens (fp32 CPU), a drafter named with
its dry steps runs with them, and the modes' engines take each wave in turn."""
from __future__ import annotations

import json

from benchmarks.harness import speculative_bench


def test_a_quick_run_compares_every_drafter_on_the_same_tokens(tmp_path, monkeypatch):
    made, order = [], []
    engine = speculative_bench._engine

    def noted(make_engine, batch, drafter):
        eng = engine(make_engine, batch, drafter)
        made.append((drafter, None if eng.speculator is None else eng.speculator.dry_steps))
        run = eng.run_until_done
        eng.run_until_done = lambda: order.append(drafter) or run()
        return eng
    monkeypatch.setattr(speculative_bench, "_engine", noted)
    assert speculative_bench.main(["--quick", "--drafters", "suffix,suffix/dry=8", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-ws-speculative.json")
    rows = json.loads(path.read_text())["rows"]
    batch = [r for r in rows if r["measure"] == "batch"]
    assert {(r["batch"], r["drafter"], r["pass"]) for r in batch} == {
        (b, d, p) for b in (1, 8) for d in ("suffix", "suffix/dry=8") for p in ("cold", "warm")}
    assert all(r["identical"] == 1.0 for r in rows), rows
    # per batch size the three modes' engines (the CPU's own dry steps, 0, and the named 8), then the tail's two
    modes = [(None, None), ("suffix", 0), ("suffix/dry=8", 8)]
    assert made == modes + modes + [(None, None), ("suffix", 0)], made
    # each wave (one per pass here: batch 1 and 8, cold and warm) run by every mode in turn; then the tail's
    assert order == [None, "suffix", "suffix/dry=8"] * 4 + [None, "suffix"], order
