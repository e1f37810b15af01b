"""RoPE with the KV write in one C pass (csrc/cpu_rope_kv.c): the torch ops' bits, and bad indices refused."""
import pytest
import torch
from transformers import LlamaConfig

from rollout_service.ops import cpu_rope, select_ops
from rollout_service.ops.attention import write_kv
from rollout_service.ops.rope import apply_rope, build_cos_sin_cache


def step(tokens, heads, dim, page_size=16, seed=0):
    """q, k, v as slices of one fused qkv product (strided, as the model makes them), positions, slots, a cache
    of NaN and the rope table."""
    gen = torch.Generator().manual_seed(seed)
    hq, hk = heads
    qkv = torch.randn(tokens, (hq + 2 * hk) * dim, generator=gen) * 3
    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split([hq * dim, hk * dim, hk * dim], dim=-1))
    config = LlamaConfig(head_dim=dim, hidden_size=hq * dim, num_attention_heads=hq, num_key_value_heads=hk)
    cos_sin = build_cos_sin_cache(config, 4096)
    num_pages = tokens // page_size + 3
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:tokens]
    kv = torch.full((num_pages, 2, hk, page_size, dim), float("nan"))
    return q, k, v, positions, slots, kv, cos_sin


@pytest.mark.parametrize("tokens,heads,dim", [(1, (9, 3), 64), (32, (4, 2), 8), (300, (14, 2), 128)])
def test_same_bits_as_the_torch_rope_and_write(tokens, heads, dim):
    q, k, v, positions, slots, kv, cos_sin = step(tokens, heads, dim)
    assert cpu_rope.applies(q, k, v, cos_sin, kv), "this machine builds the CPU kernels (a C compiler with OpenMP)"
    out = select_ops("torch").rope_and_write_kv(q, k, v, positions, cos_sin, kv, slots)
    q_ref, k_ref = apply_rope(q, k, positions, cos_sin)
    kv_ref = torch.full_like(kv, float("nan"))
    write_kv(kv_ref, k_ref, v, slots)
    assert torch.equal(out, q_ref)
    assert torch.equal(kv.isnan(), kv_ref.isnan())  # only the step's slots written
    assert torch.equal(kv.nan_to_num(), kv_ref.nan_to_num())


def test_positions_and_slots_out_of_range_are_refused():
    q, k, v, positions, slots, kv, cos_sin = step(4, (4, 2), 8)
    ops = select_ops("torch")
    with pytest.raises(ValueError, match="token 2: position 4096 outside 0..4095"):
        ops.rope_and_write_kv(q, k, v, torch.tensor([0, 1, 4096, 3]), cos_sin, kv, slots)
    with pytest.raises(ValueError, match="token 0: KV slot -1 outside"):
        ops.rope_and_write_kv(q, k, v, positions, cos_sin, kv, torch.tensor([-1, 0, 1, 2]))
    assert kv.isnan().all()  # nothing written by a refused step
