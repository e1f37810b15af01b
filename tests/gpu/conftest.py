"""GPU tests: skipped (per module, via `pytestmark`) without CUDA; the kernels build once per session."""
import pytest
import torch


@pytest.fixture(scope="session")
def cuda_ops():
    from rollout_service.ops.cuda_ops import CudaOps

    return CudaOps()  # builds the extension: a broken build fails the tests, it does not skip them


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
