"""`rollout-service` CLI and `python -m rollout_service.launch`: run, stats, bench delegation, errors."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rollout_service import cli, launch
from rollout_service.types import load_results

pytest_plugins = ["ray_fixtures"]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def tiny_yaml(tmp_path, service_config):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join([json.dumps([7, 8, 9]), json.dumps({"prompt": [1, 2], "metadata": "m1"}),
                                  json.dumps({"prompt": [3, 4, 5], "sampling": {"max_tokens": 2}})]) + "\n")
    cfg = service_config(name="svc-cli", prompts=str(prompts), output=str(tmp_path / "out.msgpack"),
                         sampling={"n": 2, "max_tokens": 5, "ignore_eos": True})
    path = tmp_path / "svc.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.ray
def test_run_rolls_out_writes_msgpack_and_prints_metrics(ray_cluster, tiny_yaml, tmp_path, capsys):
    assert cli.main(["run", "--config", str(tiny_yaml)]) == 0
    out = capsys.readouterr().out
    assert "rollout metrics" in out and "output_tokens" in out and "tokens_per_s" in out
    results = load_results(tmp_path / "out.msgpack")
    assert [(r.request_id, r.sample_index) for r in results] == [(f"prompt-{i}", j) for i in range(3) for j in (0, 1)]
    assert [len(r.token_ids) for r in results] == [5, 5, 5, 5, 2, 2]  # per-prompt sampling overrides apply
    assert results[2].metadata == "m1"


@pytest.mark.ray
def test_stats_of_a_running_service(ray_cluster, service_config, capsys):
    from rollout_service.service import RayBackend
    b = RayBackend.launch(service_config(name="svc-stats"))
    try:
        assert cli.main(["stats", "--name", "svc-stats"]) == 0
        out = capsys.readouterr().out
        assert "policy version 0" in out and out.count("True") >= 2
        # another process (another Ray job) attaches to the named service
        proc = subprocess.run([sys.executable, "-m", "rollout_service.cli", "stats", "--name", "svc-stats",
                               "--address", ray_cluster.address], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0 and "policy version 0" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    finally:
        b.close()
    assert cli.main(["stats", "--name", "svc-stats"]) == 2
    assert "no rollout service named 'svc-stats'" in capsys.readouterr().out


def test_bad_inputs_exit_2_with_the_reason(tmp_path, capsys):
    assert cli.main(["run", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_workers: 2\nengine: {model: x}\nsampling: {temperature: -3}\n")
    assert launch.main(["--config", str(bad)]) == 2
    assert "SamplingParams.temperature" in capsys.readouterr().err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [1]}\nnot json\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: not JSON"):
        launch.load_prompts(str(prompts))
    with pytest.raises(SystemExit):
        cli.main(["frobnicate"])


def test_builtin_prompts_and_bench_delegation(capsys):
    recs = launch.load_prompts(None, limit=3)
    assert len(recs) == 3 and recs[0]["metadata"]["answer"] == "Paris"
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--help"])  # everything after `bench` goes to the benchmark harness
    assert e.value.code == 0 and "W1" in capsys.readouterr().out
    assert cli.parser().parse_args(["build-kernels"]).command == "build-kernels"


@pytest.mark.ray
@pytest.mark.slow
def test_local_cpu_yaml_with_the_embedded_model(tmp_path):
    """The README command: a fresh process starts its own local Ray with 2 workers of SmolLM2-135M."""
    out = tmp_path / "res.msgpack"
    proc = subprocess.run([sys.executable, "-m", "rollout_service.cli", "run", "--config",
                           "cluster_configs/local-cpu.yaml", "--num-prompts", "2", "--max-tokens", "8",
                           "--output", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "rollout metrics" in proc.stdout
    results = load_results(out)
    assert len(results) == 4 and all(r.text and len(r.token_ids) <= 8 for r in results)
    assert results[0].metadata == {"answer": "Paris"}
