"""gpu_check's regression check: every new figure against the newest committed one of its workload, model and
hardware (benchmarks/harness/regressions.py)."""
import json

from benchmarks.harness import regressions


def _write(path, hardware, rows):
    path.write_text(json.dumps({"meta": {"hardware": hardware}, "rows": [
        {"model": m, "workload": w, "engine": {"value": v}, "higher_is_better": hib, "unit": u}
        for m, w, v, hib, u in rows]}))
    return path


def test_a_drop_of_more_than_ten_percent_is_named(tmp_path, capsys):
    _write(tmp_path / "2026-12-01-gpu.json", "gpu", [("q", "W2", 200.0, True, "tok/s"), ("q", "W1", 0.5, False, "ms")])
    _write(tmp_path / "2026-12-03-gpu-issue9.json", "gpu", [("q", "W2", 100.0, True, "tok/s"),  # the newest W2
                                                           ("l", "W2", 50.0, True, "tok/s")])
    _write(tmp_path / "2026-12-02-cpu.json", "cpu", [("q", "W2", 1000.0, True, "tok/s")])  # other hardware
    new = _write(tmp_path / "2026-12-05-gpu.json", "gpu", [
        ("q", "W2", 85.0, True, "tok/s"),    # 15% below the newest 100 (not the older 200): warned
        ("q", "W1", 0.54, False, "ms"),      # 8% slower: within the threshold
        ("l", "W2", 70.0, True, "tok/s"),    # better
        ("x", "W2", 1.0, True, "tok/s")])    # nothing to compare with
    assert regressions.main([str(new), "--against", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["WARNING: q W2 on gpu: 85 tok/s, 15% worse than 100 in 2026-12-03-gpu-issue9.json"]
    regressions.main([str(new), "--against", str(tmp_path), "--threshold", "0.05"])
    assert "q W1 on gpu: 0.54 ms, 8% worse than 0.5" in capsys.readouterr().out


def test_no_warning_when_nothing_dropped(tmp_path, capsys):
    _write(tmp_path / "2026-12-01-gpu.json", "gpu", [("q", "W2", 100.0, True, "tok/s")])
    new = _write(tmp_path / "2026-12-02-gpu.json", "gpu", [("q", "W2", 95.0, True, "tok/s")])
    regressions.main([str(new), "--against", str(tmp_path)])
    assert capsys.readouterr().out.startswith("no figure more than 10% worse")
