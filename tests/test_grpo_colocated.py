"""The colocated GRPO step on CPUs, with real processes: a learner actor placed in worker 0's bundle
(`colocate: true`), two CPU workers that sleep around every learner phase and wake with the new weights.
The GPU run of the same step is tests/gpu/test_grpo_colocated_gpu.py; W6 (the benchmark) runs here too, on a
tiny model, so its code path cannot rot between GPU runs."""
from __future__ import annotations

import math

import pytest
import ray

from actors.grpo import GRPOActor
from rollout_service.client import RolloutClient

pytest_plugins = ["ray_fixtures"]
# (reward and prompt functions from an importable module: a learner actor unpickles them)
from benchmarks.harness.rl_step import parity_reward, token_prompt  # noqa: E402

pytestmark = pytest.mark.ray

PHASES = ("rollout", "reward", "learner", "refresh", "sleep", "wake", "idle")


@pytest.fixture(scope="module")
def svc(ray_cluster, service_config):
    with RolloutClient.launch(service_config(name="svc-coloc", namespace="rollout_service", colocate=True)) as c:
        yield c


def test_two_colocated_grpo_steps_on_cpu_workers(svc, tiny_model_dir):
    cfg = dict(group_size=4, prompts_per_step=3, max_tokens=8, ignore_eos=True, lr=1e-3, micro_batch=6,
               colocate="auto", sleep_level=1, seed=1)
    learner = GRPOActor.options(**svc.colocated_options(0)).remote(
        tiny_model_dir, "svc-coloc", cfg, reward_fn=parity_reward, prompt_fn=token_prompt)
    here = ray.get(learner.__ray_call__.remote(lambda self: ray.get_runtime_context().get_placement_group_id()))
    assert here is not None  # in the workers' placement group, beside worker 0
    problems = [[[1, 2, 3], [4, 5, 6, 7], [9, 8]], [[3, 3], [5, 1, 2, 6], [7]]]
    rows = [ray.get(learner.step.remote(p, fp32_reference=4)) for p in problems]
    assert [r["step"] for r in rows] == [1, 2] and all(r["colocated"] for r in rows)
    for r in rows:
        for p in PHASES:
            assert math.isfinite(r[f"{p}_s"]) and r[f"{p}_s"] >= 0, p
        for p in ("rollout", "learner", "refresh", "sleep", "wake"):
            assert r[f"{p}_s"] > 0, p  # each call was made
        assert sum(r[f"{p}_s"] for p in PHASES) == pytest.approx(r["step_s"], rel=1e-3)
        assert r["rollout_tokens"] == 3 * 4 * 8 and r["rollout_wait_tokens_per_s"] > 0
        # memory figures from the CPU path: the learner's resident set; the workers asleep at level 1 keep
        # their weights (host memory) but not their KV cache
        assert r["learner_memory"]["device"] == "cpu" and r["learner_memory"]["rss"] > 50 * 2**20
        assert 0 < r["engine_memory_asleep"]["device_memory_bytes"]
        # fp32 on both sides, same weights: the recompute agrees to float noise, and so does the fp32 reference
        assert r["mismatch_tokens"] > 0 and r["mismatch_max"] < 1e-3 and r["ratio_max"] < 1.01
        assert r["fidelity_vs_fp32"]["rollout_vs_fp32"]["max_abs"] < 1e-3
    stats = svc.stats()
    assert all(s["sleep_level"] == 0 and s["policy_version"] == 2 for s in stats)
    assert all(s["last_refresh"]["transport"] == "object_store" for s in stats)  # CPU tensors: the object store
    reports = {f["version"]: f for f in svc.info()["fidelity"]}
    assert set(reports) >= {0, 1} and reports[1]["n_tokens"] == rows[1]["mismatch_tokens"]
    assert [r.token_versions[0] for r in svc.generate([[1, 2]])] == [2]
    ray.kill(learner)


def test_w6_runs_on_a_tiny_model(ray_cluster, tmp_path):
    """W6fp8 only: it runs W6's code (w6_rl_step with FP8 engine options) in one service start instead of two; the
    plain colocated step is the test above."""
    import json

    from benchmarks.harness import main
    rc = main(["--quick", "--device", "cpu", "--model", "tiny-llama", "--workloads", "W6fp8", "--out", str(tmp_path)])
    assert rc == 0
    rows = {r["workload"]: r for p in tmp_path.glob("*.json") for r in json.loads(p.read_text())["rows"]}  # a file a workload
    step, share, rate = rows["W6fp8"], rows["W6fp8 overhead"], rows["W6fp8 rollout"]
    assert step["engine"]["value"], step["engine"]["note"]
    assert step["engine"]["value"] > 0 and step["details"]["steps_run"] == 2
    assert 0 < share["engine"]["value"] < 1 and rate["engine"]["value"] > 0 and rate["other_peer"]["value"] > 0
    s1 = step["details"]["step1"]
    assert all(s1[f"{p}_s"] >= 0 for p in PHASES) and s1["sleep_s"] > 0 and s1["wake_s"] > 0
    assert step["details"]["fidelity_reports"] and "step1_fidelity_vs_fp32" in step["details"]
    assert step["details"]["learner"]["rollout_correction"] == "tis"
    # FP8 rollouts (bf16 e4m3 products) against the float32 learner: further off than float32 rollouts ever are
    # (the test above bounds their largest mismatch by 1e-3)
    assert s1["mismatch_mean"] > 1e-3, s1
