"""Delta refreshes on a GPU (weights/delta.py): the learner's encoding of CUDA tensors sends the same bytes as the
CPU's, and decoding on the device patches the weights to exactly the new cast; corrupt positions are refused
there too."""
import pytest
import torch
from delta_states import before_and_after
from kv_utils import requires_cuda

from rollout_service.weights.buckets import Buckets, named_items, plan
from rollout_service.weights.delta import apply, decode, encode

pytestmark = pytest.mark.skipif(**requires_cuda)
BF16 = torch.bfloat16


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
    old, new = before_and_after(seed)
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
