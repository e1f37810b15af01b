"""The benchmark harness cannot rot: a --quick run on a tiny random model, checked cell by cell."""

import glob
import json
import os

import numpy as np
import pytest
import torch

from benchmarks.harness import main
from benchmarks.harness.ceilings import Ceilings, decode_step_floor
from benchmarks.harness.context import parse_shape
from benchmarks.harness.engine_side import kv_pages
from benchmarks.harness.report import Cell, Row, render_markdown
from benchmarks.harness.workloads import experts_read_per_step, prefix_agreement


def _load(out_dir):
    """The run in out_dir, its files (one per workload: <date>-<hardware>-<workload>.json and .md) read as one:
    (the first JSON's path, {"meta", "ceilings", "rows" of every file}, every .md)."""
    paths = sorted(glob.glob(os.path.join(out_dir, "*.json")))
    assert paths
    docs, mds = [], []
    for path in paths:
        with open(path) as f, open(path[:-5] + ".md") as g:
            docs.append(json.load(f))
            mds.append(g.read())
        workload = docs[-1]["meta"]["workload"]
        assert path.endswith(f"-{workload.lower()}.json") and "earlier_runs" not in docs[-1], path
        assert {r["workload"].split()[0] for r in docs[-1]["rows"]} == {workload}, path
    assert len({d["meta"]["started_utc"] for d in docs}) == 1  # one run
    doc = {"meta": docs[0]["meta"], "ceilings": docs[0]["ceilings"], "rows": [r for d in docs for r in d["rows"]]}
    return paths[0], doc, "\n".join(mds)


def _expected_ratio(row, peer):
    a, b = row["engine"]["value"], row[peer]["value"]
    return a / b if row["higher_is_better"] else b / a


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    torch.manual_seed(0)
    out = str(tmp_path_factory.mktemp("bench"))
    # The W3 rows through the service start a Ray instance: tests/test_ray_weights.py runs them.
    rc = main(["--quick", "--model", "tiny-llama", "--workloads", "W1,W2,W2n,W2p,W3,W4,W5,WBI", "--out", out,
               "--skip", "service"])
    assert rc == 0
    return _load(out)


def test_quick_report_names_hardware_and_versions(quick_run):
    path, doc, md = quick_run
    meta = doc["meta"]
    assert os.path.basename(path).startswith(meta["started_utc"][:10] + "-cpu-")
    assert meta["torch"] == torch.__version__
    import transformers
    assert meta["transformers"] == transformers.__version__ and transformers.__version__ in md
    assert doc["ceilings"]["bandwidth_Bps"] > 0 and doc["ceilings"]["matmul_flops"] > 0
    assert meta["hardware"] in md
    assert not meta.get("errors"), meta.get("errors")


@pytest.mark.parametrize("workload", ["W1", "W2", "W2n", "W2p"])
def test_quick_generation_rows_have_engine_peers_floor_and_ratios(quick_run, workload):
    _, doc, md = quick_run
    (row,) = [r for r in doc["rows"] if r["workload"] == workload]
    for col in ("engine", "hf_generate", "hf_generate_batch", "floor"):
        assert row[col]["value"] is not None and row[col]["value"] > 0, (col, row[col])
    for peer in ("hf_generate", "hf_generate_batch", "floor"):
        assert row["ratios"][f"engine/{peer}"] == pytest.approx(_expected_ratio(row, peer))
    # The markdown row carries the same numbers: engine/generate ratio printed to 2 decimals.
    line = next(ln for ln in md.splitlines() if ln.startswith(f"| tiny-llama | {workload} |"))
    r = row["ratios"]["engine/hf_generate"]
    assert (f"{r:.2f}x" if r >= 0.1 else f"{r:.2g}x") in line


def test_quick_long_prompt_row_names_its_shape_and_fits_its_pool(quick_run):
    _, doc, _ = quick_run
    (row,) = [r for r in doc["rows"] if r["workload"] == "W2p"]
    shapes = doc["meta"]["shapes"]
    assert f"n={shapes['w2p_n']}" in row["metric"] and f"prompt {shapes['w2p_prompt']}" in row["metric"]
    assert row["engine"]["value"] > 0 and row["details"]["hf_generate_s"] > 0
    # The pool counts the shared prompt pages once per prompt (the quick prompt, 40 tokens, ends in a
    # partial page each fork copies; 12 new tokens take every sample into a page of its own): it must still
    # hold every sample without preempting one (an --engine-opt num_pages=20 run preempts).
    assert row["details"]["engine_preemptions"] == 0


def test_kv_pages_count_shared_prompt_pages_once():
    # W2p's GPU shape: 32 prompts x n=16, prompt 1000 (62 full pages + a partial one), 64 new.
    assert kv_pages(512, 1064, 16, n=16, prompt_len=1000) == 32 * 62 + 512 * (67 - 62) + 8
    assert kv_pages(256, 384) == 256 * 24 + 8  # n=1: nothing shared
    with pytest.raises(ValueError, match="n=3"):
        kv_pages(8, 64, n=3)


def test_quick_greedy_rows_check_tokens_against_hf(quick_run):
    _, doc, _ = quick_run
    for name in ("W1", "W2"):
        (row,) = [r for r in doc["rows"] if r["workload"] == name]
        # fp32 tiny model on the CPU: the engine's greedy tokens equal HF's almost everywhere.
        assert row["details"]["greedy_agreement_with_hf_generate"] >= 0.9
        assert row["details"]["engine_backend"] == "torch"  # what the engine reported, on the CPU


def test_quick_refresh_and_kernel_rows(quick_run):
    _, doc, _ = quick_run
    rows = {r["workload"]: r for r in doc["rows"]}
    w3 = rows["W3 local"]
    assert w3["engine"]["value"] > 0 and w3["details"]["tokens_changed_by_refresh"] is True
    assert w3["details"]["agreement_with_hf_on_new_weights"] >= 0.9
    for transport in ("object_store", "cuda_ipc", "broadcast (gloo)", "sleep/wake"):
        assert rows[f"W3 {transport}"]["engine"]["note"] == "skipped by --skip"
    w4 = [r for r in doc["rows"] if r["workload"].startswith("W4 decode[torch]")]
    assert len(w4) == 2 * 2  # two head shapes x batches (1, 4) x context 64
    for r in w4:
        assert r["engine"]["value"] > 0 and r["other_peer"]["value"] > 0
        assert r["ratios"]["engine/other_peer"] == pytest.approx(_expected_ratio(r, "other_peer"))
    assert rows["W5"]["engine"]["value"] is None and "GPU" in rows["W5"]["engine"]["note"]


def test_quick_batch_invariant_rows_time_both_modes_and_find_every_sequence_bitwise_equal(quick_run):
    _, doc, _ = quick_run
    shapes = doc["meta"]["shapes"]
    rows = {r["workload"]: r for r in doc["rows"] if r["workload"].startswith("WBI")}
    sizes = {"WBI W2": shapes["w2_seqs"], "WBI W2n": shapes["w2n_prompts"] * shapes["w2n_n"]}
    assert set(rows) == set(sizes)
    for name, seqs in sizes.items():
        row, d = rows[name], rows[name]["details"]
        assert row["engine"]["value"] > 0 and row["other_peer"]["value"] > 0
        assert "batch_invariant off" in row["other_peer"]["note"] and d["invariant_backend"] == "torch"
        assert d["cost"] == pytest.approx(1 - row["engine"]["value"] / row["other_peer"]["value"], abs=1e-4)
        # every sequence of the quick run checked (wbi_check >= its size), none differing by a bit
        assert d["bitwise_checked"] == f"alone {seqs}, learner {seqs} of {seqs} sequences"
        assert d["bitwise_alone"] == d["bitwise_learner"] == f"{seqs}/{seqs}"


def test_batch_invariant_checks_count_a_single_flipped_bit():
    """Both comparisons are of bytes: one log-prob one ulp off makes its sequence count as unequal."""
    import dataclasses

    from rollout_service import RolloutClient
    from benchmarks.harness import batch_invariant as wbi
    from benchmarks.harness.context import QUICK, BenchContext
    from benchmarks.harness.engine_side import sampling
    from benchmarks.harness.models import load_bench_model, random_prompts

    bm = load_bench_model("tiny-llama", torch.device("cpu"))
    ctx = BenchContext(bm, None, QUICK, "torch")
    row = Row("tiny-llama", "WBI", "", "tok/s", True)
    prompts, sp = random_prompts(2, 16, bm.vocab_size, seed=3), sampling(8, 2, 1.0, 0, wbi.LOGPROBS_MODE)
    with RolloutClient.local(model=bm.hf_model, backend="torch", device="cpu", num_pages=32,
                             batch_invariant=True) as client:
        results = client.generate(prompts, sampling=sp)
        bad = results[3].logprobs.copy()
        bad[5] = np.nextafter(bad[5], np.float32(0))
        results[3] = dataclasses.replace(results[3], logprobs=bad)
        assert wbi._alone(client, prompts, sp, [0, 1, 2, 3], results) == "3/4"
    assert wbi._learner(ctx, row, torch.float32, results, 1.0) == "3/4"


def test_failed_part_becomes_na_and_the_rest_still_runs_repeated(tmp_path):
    rc = main(["--quick", "--model", "tiny-llama", "--workloads", "W1", "--out", str(tmp_path),
               "--engine-opt", "no_such_option=1", "--skip", "tiny-llama:W1:hf_generate_batch",
               "--repeats", "2"])
    assert rc == 0
    _, doc, md = _load(str(tmp_path))
    (row,) = doc["rows"]
    assert row["engine"]["value"] is None and row["engine"]["note"].startswith("error:")
    assert row["hf_generate"]["value"] > 0
    # Two runs, the best (fastest ms/step) kept.
    runs = row["details"]["hf_generate_runs"]
    assert len(runs) == 2 and row["hf_generate"]["value"] == pytest.approx(min(runs), rel=1e-3)
    assert row["hf_generate_batch"]["note"] == "skipped by --skip"
    assert row["ratios"]["engine/hf_generate"] is None
    assert "no_such_option" in " ".join(doc["meta"]["errors"])


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit):
        main(["--workloads", "W9"])
    with pytest.raises(ValueError, match="gpt-17"):
        main(["--model", "gpt-17", "--device", "cpu", "--out", "/nonexistent"])
    with pytest.raises(ValueError, match="w2_sequences"):
        parse_shape("w2_sequences=3")
    assert parse_shape("w4_batches=1,32") == ("w4_batches", (1, 32))


def test_ratio_direction_and_floor():
    fast = Row("m", "W", "ms/step", "ms", False, engine=Cell(2.0), hf_generate=Cell(6.0), floor=Cell(1.0))
    assert fast.perf_ratio(fast.hf_generate) == 3.0 and fast.perf_ratio(fast.floor) == 0.5
    tput = Row("m", "W", "tok/s", "tok/s", True, engine=Cell(30.0), hf_generate=Cell(10.0), floor=Cell(60.0))
    assert tput.perf_ratio(tput.hf_generate) == 3.0 and tput.perf_ratio(tput.floor) == 0.5
    assert tput.perf_ratio(Cell.na("x")) is None
    ceil = Ceilings("cpu", 1, bandwidth_Bps=100.0, matmul_n=1, matmul_dtype="f", matmul_flops=1000.0)
    # Memory bound: (weights 50 + kv 50) / 100 B/s = 1 s vs 2 * 10 params * 1 / 1000 = 0.02 s.
    assert decode_step_floor(50, 50, 10, 1, ceil) == 1.0
    # Compute bound at a large batch: 2 * 10 * 100 / 1000 = 2 s.
    assert decode_step_floor(50, 50, 10, 100, ceil) == 2.0
    # A faster read-only stream (CPU) lowers the memory-bound floor: 100 B / 200 B/s.
    ceil.read_Bps = 200.0
    assert decode_step_floor(50, 50, 10, 1, ceil) == 0.5
    md = render_markdown({"started_utc": "2026-01-01T00:00:00Z", "hardware": "H", "torch": "t",
                          "transformers": "tf", "python": "p", "device": "cpu", "command": "c"},
                         None, [tput])
    assert "| m | W | tok/s [tok/s] | 30 | 10 | n/a | n/a | 60 | 3.00x | n/a | n/a | 0.50 |" in md


def test_prefix_agreement():
    assert prefix_agreement([[1, 2, 3, 4]], [[1, 2, 9, 4]]) == 0.5
    assert prefix_agreement([[1, 2], [3]], [[1, 2], [3]]) == 1.0


def test_experts_read_per_step_counts_distinct_experts_per_layer():
    # two sequences, three tokens (the first from the prefill: not counted), two layers, top-2
    a = np.array([[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[4, 5], [6, 7]]], dtype=np.uint8)
    b = np.array([[[7, 6], [5, 4]], [[1, 2], [3, 4]], [[4, 5], [6, 7]]], dtype=np.uint8)
    # step 1: layer 0 {0,1,2} + layer 1 {2,3,4} = 6; step 2: {4,5} + {6,7} = 4
    assert experts_read_per_step([a, b]) == 5.0
    assert experts_read_per_step([a, None]) is None and experts_read_per_step([]) is None


def test_quick_moe_run_counts_experts_in_its_floors_and_caps_the_peers(tmp_path):
    rc = main(["--quick", "--model", "tiny-qwen3-moe", "--workloads", "W2,W1,WM,WMF", "--out", str(tmp_path),
               "--peer-new-tokens", "4", "--skip", "hf_generate_batch", "--skip", "hf_static"])
    assert rc == 0
    _, doc, _ = _load(str(tmp_path))
    assert not doc["meta"].get("errors"), doc["meta"].get("errors")
    rows = {r["workload"]: r for r in doc["rows"]}
    w2, w1 = rows["W2"], rows["W1"]
    assert w2["details"]["floor_experts_basis"] == "counted from the engine's routed experts"
    assert 2 <= w2["details"]["floor_experts_read_per_layer"] <= 8  # top-2 of 8, 4 sequences
    assert w1["details"]["floor_experts_read_per_layer"] == 2.0
    assert w2["details"]["hf_new_tokens"] == w1["details"]["hf_new_tokens"] == 4
    assert w2["hf_generate"]["value"] > 0 and w1["hf_generate"]["value"] > 0
    assert rows["WM"]["engine"]["value"] is None  # a GPU workload
    fidelity = rows["WMF"]["details"]
    assert fidelity["mean_entropy_nats"] == pytest.approx(1.5, abs=0.05)
    for key in ("own_routing", "replay"):
        assert fidelity[key]["n_tokens"] == 64 * 128 and fidelity[key]["max_abs"] < 1e-3  # fp32 on both sides


def test_quick_fp8_and_wide_rows_count_fp8_bytes_in_their_floors(tmp_path):
    rc = main(["--quick", "--model", "tiny-llama", "--dtype", "bfloat16", "--workloads", "W2,W2fp8,W1fp8,W2w",
               "--out", str(tmp_path)])
    assert rc == 0
    _, doc, md = _load(str(tmp_path))
    rows = {r["workload"]: r for r in doc["rows"]}
    assert not doc["meta"].get("errors"), doc["meta"].get("errors")
    for name in ("W2fp8", "W1fp8", "W2w"):
        assert rows[name]["engine"]["value"] > 0 and rows[name]["floor"]["value"] > 0, rows[name]
    # the same workload reads fewer weight bytes with e4m3 projections: a higher tok/s floor
    assert rows["W2fp8"]["floor"]["value"] > rows["W2"]["floor"]["value"]
    assert rows["W2fp8"]["hf_generate"]["note"] == "see W2: the same peers"
    assert "8 seqs" in rows["W2w"]["metric"] and rows["W2w"]["hf_generate"]["value"] > 0


def test_profile_breakdown_classes_kernels_and_finds_the_lm_head_and_idle_time():
    from benchmarks.harness.decode_profile import breakdown
    # decode_reduce_kernel (attention's split combine, batch 1) is attention, not a sampling step boundary
    step = [("rms_norm_kernel", 2.0), ("nvjet_tst_128x64", 10.0), ("decode_kernel<bf16>", 5.0),
            ("decode_reduce_kernel<bf16>", 1.0), ("sm90_xmma_gemm_bf16", 8.0), ("Memcpy HtoD", 1.0), ("nvjet_tst_256x128", 20.0),
            ("argmax_logsumexp_kernel", 4.0), ("argmax_logsumexp_combine_kernel", 1.0)]
    events, t = [], 0.0
    for _ in range(3):  # three steps, each kernel right after the last, then a 9 µs gap
        for name, dur in step:
            events.append((name, t, dur))
            t += dur
        t += 9.0
    found = breakdown(events)
    assert found["steps"] == 3 and found["kernels"] == 27
    per = found["per_class_us"]
    assert per["lm_head"] == 60.0 and per["gemm"] == 54.0 and per["sampling"] == 15.0
    assert per["attention"] == 18.0 and per["norm_rope_act"] == 6.0 and per["copy"] == 3.0
    assert found["busy_us"] == 156.0 and found["span_us"] == 156.0 + 2 * 9.0
    assert found["top"][0][0] == "nvjet_tst_256x128"


def test_quick_contended_rows_run_engine_and_peers_beside_busy_neighbours(tmp_path):
    from pathlib import Path

    from benchmarks.harness.contention import NEIGHBOUR_CODE
    rc = main(["--quick", "--model", "tiny-llama", "--workloads", "W2c,W1c", "--out", str(tmp_path)])
    assert rc == 0
    _, doc, _ = _load(str(tmp_path))
    rows = {r["workload"]: r for r in doc["rows"]}
    for name in ("W2c", "W1c"):
        row = rows[name]
        assert row["engine"]["value"] > 0 and row["hf_generate"]["value"] > 0, row
        assert row["metric"].startswith("2 busy neighbour processes") and row["details"]["neighbours"] == 2
    spinning = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if cmdline.read_bytes().endswith(NEIGHBOUR_CODE.encode() + b"\0"):
                spinning.append(cmdline)
        except OSError:
            pass  # a process that ended meanwhile
    assert not spinning, "the neighbours are gone once the rows are done"
