"""RMSNorm, fused add+RMSNorm, RoPE, KV write and fused RoPE+KV write kernels vs the torch reference."""
import pytest
import torch
from kv_utils import PAGE, TOL, rel_err, requires_cuda

from rollout_service.ops import attention, norm, rope

pytestmark = pytest.mark.skipif(**requires_cuda)
DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 896), (7, 4096), (33, 128), (5, 14, 64)])
def test_rms_norm(cuda_ops, dtype, shape):
    x = torch.randn(shape, dtype=dtype, device="cuda") * 3
    w = torch.rand(shape[-1], dtype=dtype, device="cuda") + 0.5
    out = cuda_ops.rms_norm(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    x64 = x.double()
    exact = w.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert rel_err(out, exact) < TOL[dtype]
    assert rel_err(out, norm.rms_norm(x, w, 1e-6)) < 2e-3  # same roundings as the reference


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 896), (13, 4096), (64, 1024)])
def test_add_rms_norm_updates_residual_in_place(cuda_ops, dtype, rows, hidden):
    x = torch.randn(rows, hidden, dtype=dtype, device="cuda")
    residual = torch.randn(rows, hidden, dtype=dtype, device="cuda")
    w = torch.rand(hidden, dtype=dtype, device="cuda") + 0.5
    ref_y, ref_res = norm.add_rms_norm(x, residual.clone(), w, 1e-5)
    y, new_res = cuda_ops.add_rms_norm(x, residual, w, 1e-5)
    assert new_res.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(new_res, ref_res, rtol=0, atol=0)  # one rounded add: bit-identical
    assert rel_err(y, ref_y) < 2e-3


def _qkv(tokens: int, hq: int, hk: int, d: int, dtype: torch.dtype):
    """q, k, v as strided views of one fused projection output, like a qkv_proj would give."""
    fused = torch.randn(tokens, (hq + 2 * hk) * d, dtype=dtype, device="cuda")
    q, k, v = fused.split([hq * d, hk * d, hk * d], dim=1)
    return q.view(tokens, hq, d), k.view(tokens, hk, d), v.view(tokens, hk, d)


def _cos_sin(d: int, dtype: torch.dtype, max_pos: int = 8192) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    freqs = torch.arange(max_pos, device="cuda").float()[:, None] * inv[None]
    return torch.cat([freqs.cos(), freqs.sin()], -1).to(dtype)


HEADS = [(14, 2, 64), (32, 8, 128)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,d", HEADS)
@pytest.mark.parametrize("table_dtype", ["float32", "model"])
def test_rope_matches_reference(cuda_ops, dtype, hq, hk, d, table_dtype):
    tokens = 37
    q, k, _ = _qkv(tokens, hq, hk, d, dtype)
    cos_sin = _cos_sin(d, torch.float32 if table_dtype == "float32" else dtype)
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    ref_q, ref_k = rope.apply_rope(q.clone(), k.clone(), positions, cos_sin)
    out_q, out_k = cuda_ops.rope(q, k, positions, cos_sin)
    assert rel_err(out_q, ref_q) < 1e-3 and rel_err(out_k, ref_k) < 1e-3
    # same roundings as the reference: nearly every element is bit-identical
    assert (out_q == ref_q).float().mean().item() > 0.99


def _slots(tokens: int, num_pages: int) -> torch.Tensor:
    """Distinct random slots outside page 0, always including both sides of a page boundary."""
    slots = torch.randperm((num_pages - 1) * PAGE, device="cuda")[:tokens] + PAGE
    slots[:2] = torch.tensor([2 * PAGE - 1, 2 * PAGE], device="cuda")
    return slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,d", HEADS)
def test_write_kv(cuda_ops, dtype, hq, hk, d):
    tokens, num_pages = 29, 9
    _, k, v = _qkv(tokens, hq, hk, d, dtype)
    cache = torch.randn(num_pages, 2, hk, PAGE, d, dtype=dtype, device="cuda")
    slots = _slots(tokens, num_pages)
    ref = cache.clone()
    attention.write_kv(ref, k, v, slots)
    cuda_ops.write_kv(cache, k, v, slots)
    torch.testing.assert_close(cache, ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,d", HEADS)
def test_rope_and_write_kv(cuda_ops, dtype, hq, hk, d):
    tokens, num_pages = 45, 9
    q, k, v = _qkv(tokens, hq, hk, d, dtype)
    cos_sin = _cos_sin(d, dtype)
    positions = torch.randint(0, 8192, (tokens,), device="cuda")
    cache = torch.randn(num_pages, 2, hk, PAGE, d, dtype=dtype, device="cuda")
    slots = _slots(tokens, num_pages)
    ref_cache = cache.clone()
    ref_q, ref_k = rope.apply_rope(q.clone(), k.clone(), positions, cos_sin)
    attention.write_kv(ref_cache, ref_k, v, slots)
    out_q = cuda_ops.rope_and_write_kv(q, k, v, positions, cos_sin, cache, slots)
    assert rel_err(out_q, ref_q) < 1e-3
    assert rel_err(cache, ref_cache) < 1e-3
    untouched = torch.ones(num_pages * PAGE, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    flat, flat_ref = cache.permute(0, 3, 1, 2, 4).reshape(num_pages * PAGE, -1), ref_cache.permute(0, 3, 1, 2, 4)
    assert torch.equal(flat[untouched], flat_ref.reshape(num_pages * PAGE, -1)[untouched])


def test_unsupported_inputs_fall_back_to_the_reference(cuda_ops):
    # The extension is never called with inputs it would reject (an exception thrown inside it crashed
    # the process on the H200 image); CudaOps hands them to the torch reference instead.
    x = torch.randn(4, 60, dtype=torch.bfloat16, device="cuda")  # hidden % 8 != 0
    w = torch.rand(60, dtype=torch.bfloat16, device="cuda")
    torch.testing.assert_close(cuda_ops.rms_norm(x, w, 1e-6), norm.rms_norm(x, w, 1e-6), rtol=0, atol=0)
    with pytest.raises(RuntimeError):  # a wrong weight shape reaches torch, which raises
        cuda_ops.rms_norm(torch.randn(4, 64, dtype=torch.bfloat16, device="cuda"), w, 1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,inter", [(1, 4864), (3, 8), (37, 1000), (300, 14336)])
def test_silu_and_mul_matches_torch(dtype, rows, inter):
    from rollout_service.ops.backend import select_ops

    x = (torch.randn(rows, 2 * inter, device="cuda") * 3).to(dtype)
    got = select_ops("cuda").silu_and_mul(x)
    ref = select_ops("torch").silu_and_mul(x)
    assert got.shape == (rows, inter) and got.dtype == dtype
    # same rounding points as torch; only expf vs ATen's exp may differ in the last float32 bit
    mismatch = (got != ref).float().mean().item()
    print(f"silu_and_mul {dtype} {rows}x{inter}: {mismatch:.1e} of outputs differ from torch")
    assert mismatch <= 1e-3
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-5)
