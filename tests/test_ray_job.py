"""A Ray cluster started by hand (`ray start --head`, on loopback) that outlives the commands, as the README
runs it: `ray job submit` of the launch entrypoint, and `rollout-service serve` / `stats` / a learner's
`RolloutClient.connect` / `stop`, each in its own process.

The head uses token authentication (RAY_AUTH_MODE=token) with its own token file; the CLI processes are not
told the mode, only where the token is (as ~/.ray/auth_token tells them on a user's machine)."""
from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from ray_fixtures import start_ray_head, stop_ray_head

from rollout_service.results.file import load_results

pytest_plugins = ["ray_fixtures"]
pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))
CLI = [sys.executable, "-m", "rollout_service.cli"]


def _wait_for_dashboard(port: int, head: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert head.poll() is None, "ray start --head exited early"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError("the Ray dashboard (job server) did not come up")


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A Ray head on 127.0.0.1 in the foreground (--block), so stopping it stops only its processes.
    Yields (GCS address, dashboard URL, env of a process on this machine: the token's path, no auth mode)."""
    tmp = tmp_path_factory.mktemp("ray_head")
    token = tmp / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["RAY_AUTH_TOKEN_PATH"] = str(token)
    log = tmp / "head.log"
    head, ports = start_ray_head(["--dashboard-host=127.0.0.1", "--include-dashboard=true", "--num-cpus=3"],
                                 {**env, "RAY_AUTH_MODE": "token"}, log)
    try:
        _wait_for_dashboard(ports["dashboard-port"], head)
        yield f"127.0.0.1:{ports['port']}", f"http://127.0.0.1:{ports['dashboard-port']}", env
    finally:
        stop_ray_head(head, log)


def _run(cmd: list[str], env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _submit(cmd: list[str], env: dict) -> tuple[subprocess.CompletedProcess, str]:
    """`ray job submit ...` as the head's token-mode client, again while the head has no job agent ready yet (its
    dashboard port opens first); the last try and its output."""
    for _ in range(15):
        proc = _run(cmd, {**env, "RAY_AUTH_MODE": "token"})
        out = proc.stdout + proc.stderr
        if "No available agent to submit job" not in out:
            break
        time.sleep(2)
    return proc, out


def test_serve_outlives_the_command_and_other_processes_use_it(ray_head, tmp_path, service_config):
    address, _, env = ray_head
    cfg = tmp_path / "svc.yaml"
    cfg.write_text(yaml.safe_dump(service_config(name="svc-serve")))
    served = _run(CLI + ["serve", "--config", str(cfg), "--address", address], env)
    out = served.stdout + served.stderr
    assert served.returncode == 0 and "rollout service 'svc-serve' is serving" in out, out[-3000:]
    assert "rollout-service stop --name svc-serve --address" in out and "Token authentication" not in out
    try:
        stats = _run(CLI + ["stats", "--name", "svc-serve", "--address", address], env)
        assert stats.returncode == 0 and "policy version 0" in stats.stdout, (stats.stdout + stats.stderr)[-3000:]
        assert stats.stdout.count("True") == 2  # both workers alive after the serving command exited
        learner = ("import json\nfrom rollout_service import RolloutClient, SamplingParams\n"
                   f"c = RolloutClient.connect('svc-serve', address={address!r})\n"
                   "rs = c.generate([[1, 2, 3], [4, 5]], SamplingParams(n=2, max_tokens=4, ignore_eos=True, seed=0))\n"
                   "print(json.dumps([[r.request_id, len(r.token_ids), r.token_versions] for r in rs]))\n"
                   "c.close()\n")
        gen = _run([sys.executable, "-c", learner], env)
        assert gen.returncode == 0, (gen.stdout + gen.stderr)[-3000:]
        rows = json.loads(gen.stdout.strip().splitlines()[-1])
        assert len(rows) == 4 and all(n == 4 and v == [0] * 4 for _, n, v in rows)
    finally:
        stopped = _run(CLI + ["stop", "--name", "svc-serve", "--address", address], env)
    assert stopped.returncode == 0 and "stopped rollout service 'svc-serve'" in stopped.stdout, stopped.stdout
    gone = _run(CLI + ["stats", "--name", "svc-serve", "--address", address], env)
    lines = (gone.stdout + gone.stderr).strip().splitlines()
    assert gone.returncode == 2 and len(lines) == 1 and "no rollout service named 'svc-serve'" in lines[0], lines


def test_a_worker_that_cannot_start_is_one_line(ray_head, tmp_path, service_config):
    """A model path on a cluster is the workers' to judge (it may exist only on their nodes): their start-up
    failure comes back as one line, the service is cleaned up, and the command exits non-zero."""
    address, _, env = ray_head
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump(service_config(name="svc-bad-path", engine={"model": str(tmp_path / "missing")})))
    proc = _run(CLI + ["serve", "--config", str(cfg), "--address", address], env)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 2 and lines[-1].startswith("error: rollout service 'svc-bad-path' failed to start"), lines
    assert str(tmp_path / "missing") in lines[-1] and len(lines) == 2, lines  # "starting ..." and the error
    gone = _run(CLI + ["stats", "--name", "svc-bad-path", "--address", address], env)
    assert gone.returncode == 2 and "no rollout service named" in gone.stdout


def test_job_submit_of_the_launch_entrypoint_runs_and_prints_its_summary(ray_head, tmp_path, service_config):
    _, dashboard, env = ray_head
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [1 + i, 2, 3], "metadata": {"i": i}}) + "\n" for i in range(6)))
    cfg = service_config(name="svc-job", prompts=str(prompts), sampling={"n": 2, "max_tokens": 6, "seed": 1})
    (tmp_path / "svc.yaml").write_text(yaml.safe_dump(cfg))
    # a relative --output lands in the job's copy of --working-dir: the summary must say where, in full
    cmd = [RAY, "job", "submit", "--address", dashboard, "--working-dir", str(REPO), "--",
           sys.executable, "-m", "rollout_service.launch", "--config", str(tmp_path / "svc.yaml"),
           "--output", "out/results.msgpack"]
    proc, out = _submit(cmd, env)
    assert proc.returncode == 0, out[-3000:]
    assert "succeeded" in out and "rollout summary" in out
    summary = json.loads(next(ln for ln in out.splitlines() if ln.startswith("SUMMARY_JSON "))[len("SUMMARY_JSON "):])
    assert summary["prompts"] == 6 and summary["samples"] == 12 and summary["output_tokens"] == 72
    output = Path(summary["output"])
    assert output.is_absolute() and output.parts[-2:] == ("out", "results.msgpack") and output.parent.parent != REPO
    results = load_results(output)
    assert [(r.request_id, r.sample_index) for r in results] == [(f"prompt-{i}", j) for i in range(6) for j in range(2)]
    assert all(r.metadata == {"i": int(r.request_id.split("-")[1])} for r in results)


def test_a_jobs_driver_joins_the_head_it_was_submitted_to_whatever_cluster_started_last(ray_head, tmp_path):
    """The job supervisor tells an entrypoint to connect to "auto": with several Ray clusters on the machine, Ray
    takes the address in the ray_current_cluster file of the head's temp dir, which in the machine's shared
    /tmp/ray any later `ray start` (head or node) rewrites. Here another head starts after ours and that file
    names it; the job's driver must still join the head the job was submitted to."""
    address, dashboard, env = ray_head
    from ray._private.utils import get_ray_address_file
    shared = Path(get_ray_address_file(None))
    before = shared.read_text() if shared.exists() else None
    other, other_ports = start_ray_head(["--include-dashboard=false", "--num-cpus=1"], {**env, "RAY_AUTH_MODE": "token"},
                                        tmp_path / "other.log")
    try:
        shared.parent.mkdir(parents=True, exist_ok=True)
        shared.write_text(f"127.0.0.1:{other_ports['port']}")  # (what a `ray start` in /tmp/ray would write)
        entry = "import ray; ray.init(); print('JOINED', ray.get_runtime_context().gcs_address)"
        proc, out = _submit([RAY, "job", "submit", "--address", dashboard, "--", sys.executable, "-c", entry], env)
    finally:
        if before is None:
            shared.unlink(missing_ok=True)
        else:
            shared.write_text(before)
        stop_ray_head(other, tmp_path / "other.log")
    joined = next((ln.split()[-1] for ln in out.splitlines() if ln.startswith("JOINED ")), None)
    # (its GCS port: the address it names may be this machine's own IP rather than loopback)
    assert proc.returncode == 0 and joined is not None and joined.rsplit(":", 1)[1] == address.rsplit(":", 1)[1], \
        out[-3000:]
