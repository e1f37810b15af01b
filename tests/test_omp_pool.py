"""ops/omp_pool.py: release() frees the calling thread's OpenMP workers (libgomp), and torch works after it."""
import os
import threading
import time

import pytest
import torch

from rollout_service.ops import omp_pool

pytestmark = pytest.mark.skipif(omp_pool._libgomp() is None or torch.get_num_threads() < 2,
                                reason="needs torch on libgomp with at least 2 threads")


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def _settles(want, timeout: float = 5.0) -> int:
    """The process's thread count once it equals `want` (workers exit just after release returns)."""
    deadline = time.monotonic() + timeout
    while _tasks() != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return _tasks()


def test_release_frees_the_calling_threads_workers_and_torch_goes_on():
    seen = {}

    def user_thread():
        before = _tasks()
        x = torch.arange(1 << 22, dtype=torch.float32)
        seen["sum"] = float((x * 2).sum())  # parallel ops: this thread now has a pool of workers
        seen["workers"] = _tasks() - before
        seen["released"] = omp_pool.release()
        seen["after"] = _settles(before) - before
        seen["again"] = float((x * 2).sum())  # a new pool, the same answer
        seen["released_twice"] = omp_pool.release()

    t = threading.Thread(target=user_thread)
    t.start()
    t.join()
    assert seen["workers"] == torch.get_num_threads() - 1
    assert seen["released"] and seen["after"] == 0
    assert seen["again"] == seen["sum"] and seen["released_twice"]


def test_the_stepping_thread_gives_back_its_workers_when_idle():
    from tiny_models import tiny_hf_model

    from rollout_service import RolloutClient, SamplingParams

    omp_pool.release()  # this thread's own pool, if an earlier test made one
    with RolloutClient.local(tiny_hf_model("llama"), num_pages=32) as client:
        idle = _settles(_tasks())
        client.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
        # the step loop ran parallel ops on its own pool, then went idle and freed it: back to the idle count
        assert _settles(idle) == idle
