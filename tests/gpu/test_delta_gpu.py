"""Delta refreshes on a GPU (weights/delta.py): the learner's encoding of CUDA tensors sends the same bytes as the
CPU's, and decoding on the device patches the weights to exactly the new cast; corrupt positions are refused
there too."""
import pytest
import torch
from kv_utils import requires_cuda

from rollout_service.weights.buckets import Buckets, named_items, plan
from rollout_service.weights.delta import apply, decode, encode

pytestmark = pytest.mark.skipif(**requires_cuda)
BF16 = torch.bfloat16


def _pair(seed: int) -> tuple[dict, dict]:
    """Weights before and after an update: per tensor none, a few (gaps past both escape widths), some (moves far
    enough to go raw) or all of its elements changed; signed zeros."""
    g = torch.Generator().manual_seed(seed)
    old = {f"t{i}": torch.randn(n, generator=g) * 0.02 for i, n in enumerate([5, 300_000, 70_000, 4096, 1, 0, 999])}
    new = {}
    for i, (k, v) in enumerate(old.items()):
        density = [0.0, 1e-5, 0.01, 0.3, 1.0][(i + seed) % 5]
        pick = torch.rand(v.shape, generator=g) < density
        far = torch.rand(v.shape, generator=g) < 0.1
        new[k] = torch.where(pick, v + torch.where(far, 1.0, 1e-4) * torch.randn(v.shape, generator=g), v)
    new["t1"][[0, 299_999]] = -0.0
    return old, new


def _encoded(old: dict, new: dict, device: str):
    old = {k: v.to(device) for k, v in old.items()}
    items = named_items({k: v.to(device) for k, v in new.items()})
    manifest = plan(named_items(old), 700_000, BF16)
    base = Buckets(manifest, device)
    base.fill(named_items(old))
    delta, buffers = encode(manifest, items, base, 3)
    return manifest, base, delta, buffers


@pytest.mark.parametrize("seed", range(4))
def test_cuda_encoding_sends_the_cpus_bytes_and_decodes_on_the_device_to_the_new_cast(seed):
    old, new = _pair(seed)
    manifest, _, cpu_plan, cpu_buffers = _encoded(old, new, "cpu")
    manifest, base, plan_, buffers = _encoded(old, new, "cuda")
    assert plan_ == cpu_plan and any(b.sparse is not None for b in plan_.buckets)
    assert all(b.device.type == "cuda" and torch.equal(b.cpu(), c) for b, c in zip(buffers, cpu_buffers))
    weights = {k: v.clone() for k, v in base.views()}
    apply(decode(manifest, plan_, buffers, dict(base.views())), weights)
    for k, v in new.items():
        assert torch.equal(weights[k].cpu().view(torch.int16), v.to(BF16).view(torch.int16)), k


def test_a_corrupt_position_is_refused_on_the_device_before_any_write():
    old = {"w": torch.zeros(50_000)}
    new = {"w": torch.zeros(50_000)}
    new["w"][[3, 40_000]] = 0.5
    manifest, base, plan_, buffers = _encoded(old, new, "cuda")
    (sparse,) = plan_.buckets[0].sparse
    bad = buffers[0].clone()
    bad[sparse.codes_at:sparse.codes_at + sparse.width] = 0  # an escape where the count says none
    with pytest.raises(ValueError, match="'w' is corrupt: it counts 2 changed elements but its position codes hold 1"):
        decode(manifest, plan_, [bad], dict(base.views()))
