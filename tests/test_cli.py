"""`rollout-service` CLI and `python -m rollout_service.launch`: run, stats, bench delegation, errors.
(serve / stats / stop across processes on a cluster started with `ray start --head`: tests/test_ray_job.py)"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from ray_fixtures import free_ports

from rollout_service import cli, launch
from rollout_service.results.file import load_results

pytest_plugins = ["ray_fixtures"]
REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "rollout_service.cli"]
SERVED_NAMESPACE = "svc-serve-flags"


@pytest.fixture
def ray_tmp():
    """A RAY_TMPDIR of our own, so a Ray instance a CLI process starts leaves its session there (a short
    path: Ray's socket paths must fit in 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _cli(args: list[str], cwd: Path, ray_tmp: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """The CLI of this checkout in a fresh process, in `cwd`, with its Ray temporary files under `ray_tmp`."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=str(ray_tmp), PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    return subprocess.run(CLI + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _without_token_warning(output: str) -> list[str]:
    """The output's lines but the warning about this machine's own ~/.ray/auth_token, which these processes
    share with the session's test cluster (tests/test_newcomer.py tests the warning)."""
    return [line for line in output.strip().splitlines() if not line.startswith("warning: Ray's auth token")]


def _no_port() -> str:
    """HOST:PORT where nothing listens."""
    return f"127.0.0.1:{free_ports(1)[0]}"


@pytest.fixture
def tiny_yaml(tmp_path, service_config):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join([json.dumps([7, 8, 9]), json.dumps({"prompt": [1, 2], "metadata": "m1"}),
                                  json.dumps({"prompt": [3, 4, 5], "sampling": {"max_tokens": 2}})]) + "\n")
    cfg = service_config(name="svc-cli", prompts=str(prompts), sampling={"n": 2, "max_tokens": 5, "ignore_eos": True})
    path = tmp_path / "svc.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.ray
def test_run_rolls_out_writes_msgpack_and_prints_metrics(ray_cluster, tiny_yaml, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative --output is taken from here; its missing folders are made
    assert cli.main(["run", "--config", str(tiny_yaml), "--output", "runs/one/out.msgpack"]) == 0
    out = capsys.readouterr().out
    assert "rollout metrics" in out and "output tokens" in out and "output tokens/s" in out
    # the two rates are measured differently, and the table says how (the caption may wrap: compare words)
    words = " ".join(out.split())
    assert "worker 0 tokens/s (last 64 steps)" in words and "worker 1 tokens/s (last 64 steps)" in words
    assert "output tokens/s = output tokens / rollout (s)" in words and "add up to more than the total" in words
    assert f"results: {tmp_path / 'runs' / 'one' / 'out.msgpack'}" in out  # the absolute path, not the relative one
    results = load_results(tmp_path / "runs" / "one" / "out.msgpack")
    assert [(r.request_id, r.sample_index) for r in results] == [(f"prompt-{i}", j) for i in range(3) for j in (0, 1)]
    assert [len(r.token_ids) for r in results] == [5, 5, 5, 5, 2, 2]  # per-prompt sampling overrides apply
    assert results[2].metadata == "m1"


def test_help_says_what_every_option_does_and_its_default(tmp_path, ray_tmp):
    def help_of(command: str) -> str:
        proc = _cli([command, "--help"], tmp_path, ray_tmp, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return " ".join(proc.stdout.split())

    for command in ("run", "serve"):
        assert "--num-workers NUM_WORKERS rollout workers (default: the config's `num_workers`)" in help_of(command)
    for command in ("stats", "stop"):
        text = help_of(command)
        assert "--name NAME the service's name (default: rollout_service)" in text
        assert "--namespace NAMESPACE the Ray namespace it was started in" in text and \
            "(default: rollout_service)" in text.split("--namespace NAMESPACE", 1)[1]
    assert "--wide" in help_of("stats") and "--json" in help_of("stats")


@pytest.mark.ray
def test_serve_prints_only_the_flags_that_differ_from_the_defaults(ray_cluster, service_config, tmp_path, ray_tmp,
                                                                     capsys):
    """The served service is also the one whose stats this process and others read (one service start for both)."""
    cfg = tmp_path / "svc.yaml"
    config = service_config(namespace=SERVED_NAMESPACE, num_workers=1)
    del config["name"]  # the default name
    cfg.write_text(yaml.safe_dump(config))
    # --num-workers overrides the config's one worker: the stats show two
    proc = _cli(["serve", "--config", str(cfg), "--num-workers", "2", "--address", ray_cluster.address], tmp_path,
                ray_tmp, timeout=600)
    try:
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "rollout service 'rollout_service' is serving" in out, out[-3000:]
        assert " --name " not in out  # the default name needs no flag
        assert f"rollout-service stats --namespace {SERVED_NAMESPACE} --address " in out
        _stats_of_a_running_service(ray_cluster.address, capsys)
    finally:
        stop = _cli(["stop", "--namespace", SERVED_NAMESPACE, "--address", ray_cluster.address], tmp_path, ray_tmp)
    assert stop.returncode == 0 and "stopped rollout service 'rollout_service'" in stop.stdout, stop.stdout
    assert cli.main(["stats", "--namespace", SERVED_NAMESPACE]) == 2
    assert "no rollout service named 'rollout_service'" in capsys.readouterr().out


def _stats_of_a_running_service(address: str, capsys) -> None:
    """Stats of the served two-worker service from this process, then from others (other Ray jobs)."""
    assert cli.main(["stats", "--namespace", SERVED_NAMESPACE]) == 0
    out = capsys.readouterr().out
    assert "policy version 0" in out and out.count("True") >= 2
    _stats_fit_80_columns_and_say_more_on_request(address)


def _stats_fit_80_columns_and_say_more_on_request(address: str) -> None:
    """In an 80-column terminal every header and value is whole; --wide and --json give the rest."""
    def stats(*flags: str) -> str:
        proc = subprocess.run(CLI + ["stats", "--namespace", SERVED_NAMESPACE, "--address", address, *flags],
                              cwd=REPO, env={**os.environ, "COLUMNS": "80"}, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
        return proc.stdout

    table = stats()  # (another process attaching to the service by its name and namespace)
    assert "policy version 0" in table
    assert "…" not in table and max(map(len, table.splitlines())) <= 80, table
    for header in ("worker", "alive", "queued", "running", "KV pages", "used/total", "tok/s", "version"):
        assert header in table, (header, table)
    wide = stats("--wide")
    assert "…" not in wide and all(h in wide for h in ("device", "MiB", "generated", "prefilled", "hit %", "accept %")), wide
    got = json.loads(stats("--json"))
    assert [w["worker"] for w in got["workers"]] == [0, 1] and got["info"]["policy_version"] == 0
    assert all("generated_tokens" in w and "prefix_cache" in w for w in got["workers"])


def test_stats_without_a_ray_cluster_is_one_line(tmp_path, ray_tmp):
    proc = _cli(["stats", "--address", _no_port()], tmp_path, ray_tmp, timeout=60)
    out = "\n".join(_without_token_warning(proc.stdout + proc.stderr))
    assert proc.returncode == 1 and len(out.splitlines()) == 1, out[-3000:]
    assert out.startswith("error: no Ray cluster at 127.0.0.1:") and "ray start --head" in out


def test_a_bad_model_is_refused_before_ray_starts(tmp_path, ray_tmp, service_config, capsys):
    """The driver judges the model source first, where it can: every worker would run on this machine (a
    new local Ray instance), or the source is a bare name. A path on a cluster is left to its workers."""
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(service_config(name="svc-bad", engine={"model": str(tmp_path / "no-such-model")})))
    proc = _cli(["run", "--config", str(bad)], tmp_path, ray_tmp)
    out = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and out[-1] == f"error: no such file or directory: {tmp_path / 'no-such-model'} " \
                                               f"(the model path)", out[-20:]
    assert len(out) == 1  # the error alone: nothing says "starting" for what never starts
    assert not list(ray_tmp.iterdir())  # no Ray instance was started
    relative = tmp_path / "relative.yaml"  # taken from the current directory, which the message names
    relative.write_text(yaml.safe_dump(service_config(name="svc-rel", engine={"model": "missing/nope.gguf"})))
    proc = _cli(["run", "--config", str(relative)], tmp_path, ray_tmp)
    out = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and out[-1] == f"error: no such file or directory: missing/nope.gguf (the model " \
                                               f"path, relative to {tmp_path})", out[-20:]
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump(service_config(name="svc-typo", engine={"model": "smollm2-135"})))
    # serve judges a bare name before it imports Ray or reads the address: this process can ask it
    assert cli.main(["serve", "--config", str(typo), "--address", _no_port()]) == 2
    assert "unknown model source 'smollm2-135'" in capsys.readouterr().out
    proc = _cli(["serve", "--config", str(bad), "--address", _no_port()], tmp_path, ray_tmp, timeout=60)
    assert proc.returncode == 1 and "no Ray cluster at" in proc.stdout, proc.stdout + proc.stderr


def test_detached_needs_a_cluster_that_outlives_the_process(tmp_path, ray_tmp, service_config):
    cfg = tmp_path / "detached.yaml"
    cfg.write_text(yaml.safe_dump(service_config(name="svc-detached", detached=True)))
    proc = _cli(["run", "--config", str(cfg)], tmp_path, ray_tmp)
    assert proc.returncode == 2 and "detached: true needs a Ray cluster that outlives this process" in proc.stdout
    assert not list(ray_tmp.iterdir())


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
    ok = tmp_path / "ok.yaml"
    ok.write_text("num_workers: 1\n")
    assert cli.main(["run", "--config", str(ok), "--output", str(tmp_path)]) == 2  # before any Ray starts
    assert f"output {str(tmp_path)!r} is a folder" in capsys.readouterr().out
    assert cli.main(["serve", "--config", str(ok), "--openai-replicas", "-1"]) == 2  # before the service starts
    assert "--openai-replicas -1: must be >= 0" in capsys.readouterr().out


def test_prompt_files_refuse_unknown_keys_by_file_and_line(tmp_path, ray_tmp, service_config):
    """A misspelt key rolled out on the defaults (no sampling override, no metadata) without a word."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [1, 2]}\n\n{"prompt": [3], "samplng": {"n": 4}}\n')
    cfg = tmp_path / "svc.yaml"
    cfg.write_text(yaml.safe_dump(service_config(name="svc-jsonl", prompts=str(prompts))))
    proc = _cli(["run", "--config", str(cfg)], tmp_path, ray_tmp)
    out = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and out[-1] == (f"error: {prompts}:3: unknown key(s) ['samplng'] (did you mean "
                                                f"'sampling'?); a record holds ['prompt', 'metadata', 'sampling', "
                                                f"'request_id']"), out[-20:]
    assert len(out) == 1 and not list(ray_tmp.iterdir())  # refused before any Ray instance started
    prompts.write_text('{"prompt": [3], "metdata": 1}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1: unknown key\(s\) \['metdata'\] \(did you mean 'metadata'\?\)"):
        launch.load_prompts(str(prompts))
    prompts.write_text('{"prompt": [3]}\n{"prompt": [3], "sampling": {"max_token": 3}}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: unknown sampling key\(s\) \['max_token'\] \(did you mean "
                                         r"'max_tokens'\?\)"):
        launch.load_prompts(str(prompts))
    prompts.write_text('{"prompt": [3], "sampling": 3}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1: 'sampling' must be an object of SamplingParams fields"):
        launch.load_prompts(str(prompts))


def test_builtin_prompts_and_bench_delegation(capfd):
    recs = launch.load_prompts(None, limit=3)
    assert len(recs) == 3 and recs[0]["metadata"]["answer"] == "Paris"
    # everything after `bench` goes to the harness, which runs from the checkout (benchmarks/) in a process of its own
    assert cli.main(["bench", "--help"]) == 0
    assert "W1" in capfd.readouterr().out
    assert cli.parser().parse_args(["build-kernels"]).command == "build-kernels"


def _help_without_torch(code: str, usage: str) -> None:
    """`code` (Python, in a fresh process) prints a --help starting with `usage`, then `exit <code> <torch loaded>`."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.stdout.startswith(usage), proc.stdout[:500] + proc.stderr[-2000:]
    assert proc.stdout.rstrip().endswith("exit 0 False")


def test_the_demo_help_answers_before_torch_is_imported():
    """scripts/run_local.sh --help is the demo's: it took 19 s on a busy machine when torch came first."""
    _help_without_torch("import runpy, sys\nsys.argv = ['demo.py', '--help']\ntry:\n    runpy.run_path("
                        "'scripts/demo.py', run_name='__main__')\nexcept SystemExit as e:\n    print('exit', e.code, "
                        "'torch' in sys.modules)\n", "usage: demo.py")


def test_bench_help_answers_before_torch_is_imported():
    _help_without_torch("import sys\nfrom rollout_service import cli\nrc = cli.main(['bench', '--help'])\n"
                        "print('exit', rc, 'torch' in sys.modules)\n", "usage: rollout-service bench")


@pytest.mark.ray
@pytest.mark.slow
def test_local_cpu_yaml_with_the_embedded_model(tmp_path, ray_tmp):
    """The README command: a fresh process starts its own local Ray with 2 workers of SmolLM2-135M."""
    config = yaml.safe_load((REPO / "cluster_configs" / "local-cpu.yaml").read_text())
    config.setdefault("placement", {})["timeout_s"] = 600  # its workers start in seconds, or minutes on a busy box
    (tmp_path / "local-cpu.yaml").write_text(yaml.safe_dump(config))
    proc = _cli(["run", "--config", str(tmp_path / "local-cpu.yaml"), "--num-prompts", "2",
                 "--max-tokens", "8"], tmp_path, ray_tmp, timeout=800)
    out = tmp_path / "rollout_results.msgpack"  # the default: in the current directory, printed absolute
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "rollout metrics" in proc.stdout and f"results: {out}" in proc.stdout
    assert "Token authentication" not in proc.stdout + proc.stderr  # Ray's warning on every start
    results = load_results(out)
    assert len(results) == 4 and all(r.text and len(r.token_ids) <= 8 for r in results)
    assert results[0].metadata == {"answer": "Paris"}
