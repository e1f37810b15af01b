"""`device: cuda` where there is no GPU (issue 45, item 7): one line, before any model loads or worker starts."""
import time

import pytest
import torch

from rollout_service.engine.engine import Engine

pytest_plugins = ["ray_fixtures"]
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


@no_gpu
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_an_engine_on_cuda_without_a_gpu_is_one_line(tiny_model_dir, device):
    """Refused before the model loads: within 2 s of this process's CPU time (a wall-clock bound would
    measure the machine's other load, not the engine)."""
    t0 = time.process_time()
    with pytest.raises(ValueError, match=rf"EngineConfig.device='{device}': no CUDA device is visible") as e:
        Engine(model_source=tiny_model_dir, device=device)
    assert "\n" not in str(e.value) and time.process_time() - t0 < 2


@no_gpu
@pytest.mark.ray
def test_a_service_on_cuda_without_a_gpu_fails_before_any_worker_starts(ray_cluster, service_config):
    import ray

    from rollout_service.client import RolloutClient
    from ray.util import placement_group_table
    cfg = service_config(name="svc-cuda-on-cpu", num_workers=1)
    cfg["engine"]["device"] = "cuda"
    cfg["placement"] = {"timeout_s": 300}  # a launch that tried to place workers would wait this out
    groups = len(placement_group_table())
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"engine.device='cuda', but this Ray cluster has no GPU: use device: cpu"):
        RolloutClient.launch(cfg)
    assert time.monotonic() - t0 < 60 and len(placement_group_table()) == groups  # (2 s on a quiet machine)
    with pytest.raises(ValueError):
        ray.get_actor("svc-cuda-on-cpu", namespace="rollout_service")  # no router was left behind
