"""Weight transport: bucketed packing is exact for every dtype and survives the Ray object store."""
from __future__ import annotations

import pytest
import torch

from rollout_service.weights import named_items, pack, publish, unpack

pytest_plugins = ["ray_fixtures"]


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(33, 7, generator=g),
        "b.weight": torch.randn(5, generator=g).to(torch.bfloat16),
        "c.bias": torch.randn(3, 3, generator=g).to(torch.float16),
        "d.scalar": torch.tensor(1.5, dtype=torch.float64),
        "e.empty": torch.empty(0, 4),
        "f.strided": torch.randn(8, 6, generator=g).t(),   # non-contiguous view
    }


@pytest.mark.parametrize("bucket_bytes", [1, 64, 1 << 20])
def test_pack_unpack_is_exact(bucket_bytes):
    sd = _state()
    packed = pack(sd, bucket_bytes=bucket_bytes)
    out = dict(unpack(packed))
    assert list(out) == list(sd)
    for k, v in sd.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape and torch.equal(out[k], v), k
    assert (len(packed.buckets) > 1) == (bucket_bytes < 1 << 20)
    assert all(e.offset % 64 == 0 for e in packed.entries)


def test_pairs_and_bad_inputs():
    sd = _state()
    assert [k for k, _ in unpack(pack(list(sd.items())))] == list(sd)
    with pytest.raises(ValueError, match="no tensors"):
        pack({})
    with pytest.raises(ValueError, match="not a torch.Tensor"):
        pack({"x": [1, 2]})
    with pytest.raises(ValueError, match="not a string"):
        named_items([(3, torch.zeros(1))])
    with pytest.raises(ValueError, match="iterable of \\(name, tensor\\) pairs"):
        named_items(5)


def test_object_store_round_trip(ray_cluster):
    import ray
    sd = _state(1)
    got = dict(unpack(ray.get(publish(sd, bucket_bytes=256))))
    assert all(torch.equal(got[k], v) for k, v in sd.items())
