"""`ray start --head` on loopback + `ray job submit` of the launch entrypoint, as a cluster user runs it.

Ray 2.60 uses token authentication: RAY_AUTH_MODE=token is set for both the head and the submit."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rollout_service.types import load_results

pytest_plugins = ["ray_fixtures"]
pytestmark = pytest.mark.ray

REPO = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@pytest.fixture
def ray_head(tmp_path):
    """A Ray head on 127.0.0.1 in the foreground (--block), so stopping it stops only its processes."""
    gcs, dash = _free_port(), _free_port()
    # every port explicit: the session's test cluster already holds Ray's default ones on this machine
    extra = [f"--{flag}={_free_port()}" for flag in ("dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                    "runtime-env-agent-port", "metrics-export-port",
                                                    "ray-client-server-port")]
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    log = open(tmp_path / "head.log", "w")
    head = subprocess.Popen([RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
                             "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--include-dashboard=true",
                             "--num-cpus=3", "--disable-usage-stats", *extra], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        _wait_for_dashboard(dash, head)
        yield f"http://127.0.0.1:{dash}", env
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        log.close()


def test_job_submit_of_the_launch_entrypoint_runs_and_prints_its_summary(ray_head, tmp_path, tiny_model_dir,
                                                                          service_config):
    address, env = ray_head
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [1 + i, 2, 3], "metadata": {"i": i}}) + "\n" for i in range(6)))
    cfg = service_config(name="svc-job", prompts=str(prompts), output=str(tmp_path / "out.msgpack"),
                         sampling={"n": 2, "max_tokens": 6, "seed": 1})
    (tmp_path / "svc.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [RAY, "job", "submit", "--address", address, "--working-dir", str(REPO), "--",
           sys.executable, "-m", "rollout_service.launch", "--config", str(tmp_path / "svc.yaml")]
    for _ in range(15):  # the dashboard port opens before its job agent is ready to take a job
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        out = proc.stdout + proc.stderr
        if "No available agent to submit job" not in out:
            break
        time.sleep(2)
    assert proc.returncode == 0, out[-3000:]
    assert "succeeded" in out and "rollout summary" in out
    summary = json.loads(next(ln for ln in out.splitlines() if ln.startswith("SUMMARY_JSON "))[len("SUMMARY_JSON "):])
    assert summary["prompts"] == 6 and summary["samples"] == 12 and summary["output_tokens"] == 72
    results = load_results(tmp_path / "out.msgpack")
    assert [(r.request_id, r.sample_index) for r in results] == [(f"prompt-{i}", j) for i in range(6) for j in range(2)]
    assert all(r.metadata == {"i": int(r.request_id.split("-")[1])} for r in results)
