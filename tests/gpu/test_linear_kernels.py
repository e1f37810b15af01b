"""The batch-1 linear kernel (csrc/gemv.cu) vs float64 products rounded once, and vs cuBLAS."""
import pytest
import torch
import torch.nn.functional as F
from kv_utils import requires_cuda

from rollout_service.ops.torch_ops import TorchOps

pytestmark = pytest.mark.skipif(**requires_cuda)
DTYPES = [torch.bfloat16, torch.float16]
# (n, k): qwen2.5-0.5b qkv; a short odd row (tail loop only); K split over 4 warps; llama3-8b down_proj.
SHAPES = [(1152, 896), (7, 136), (512, 4864), (4096, 14336)]


def _inputs(rows: int, n: int, k: int, dtype: torch.dtype, bias: bool):
    x = torch.randn(rows, k, dtype=dtype, device="cuda")
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    b = torch.randn(n, dtype=dtype, device="cuda") if bias else None
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    return x, w, b, exact


def _error_budget(out: torch.Tensor, exact: torch.Tensor, abs_sum: torch.Tensor, k: int) -> torch.Tensor:
    """|out - exact| over what one rounding to the dtype plus float32 summation may cost: the dtype's spacing at
    exact (subnormals included) and a few float32 epsilons of sqrt(k) * sum |x_i w_i|."""
    finfo = torch.finfo(out.dtype)
    spacing = finfo.eps * torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(finfo.tiny))))
    summation = 4 * 2.0**-24 * k**0.5 * abs_sum
    return (out.double() - exact).abs() / (spacing.clamp_min(finfo.smallest_normal * finfo.eps) + summation)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_rounds_the_exact_product_once(cuda_ops, dtype, n, k, bias):
    x, w, b, exact = _inputs(1, n, k, dtype, bias)
    out = cuda_ops.linear(x, w, b)
    assert out.shape == (1, n) and out.dtype == dtype
    # A float32 sum is off the exact one far below the dtype's spacing: the output is within one rounding of the
    # exact result (plus float32 summation error where the sum cancels), and rounds to a different value no
    # more often than cuBLAS's float32 sums do.
    abs_sum = x.double().abs() @ w.double().abs().T + (b.double().abs() if bias else 0)
    assert _error_budget(out, exact, abs_sum, k).max().item() <= 1.0
    rounded = exact.to(dtype)
    peer = F.linear(x, w, b)
    assert (out != rounded).float().mean().item() <= (peer != rounded).float().mean().item() + 5e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(4864, 896), (24, 264), (14336, 4096)])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_linear_matches_reference_roundings(cuda_ops, dtype, n, k, bias):
    x, w, b, exact = _inputs(1, 2 * n, k, dtype, bias)
    out = cuda_ops.gated_linear(x, w, b)
    assert out.shape == (1, n) and out.dtype == dtype
    # The torch reference's silu_and_mul applied to the exactly rounded projection.
    expected = TorchOps().silu_and_mul(exact.to(dtype))
    # A projection one ulp off (rare, see above) moves silu(gate) * up by a few ulps at most.
    assert (out != expected).float().mean().item() < 0.05
    torch.testing.assert_close(out, expected, rtol=4 * torch.finfo(dtype).eps, atol=1e-3)


def test_logits_are_float32_sums(cuda_ops):
    hidden = torch.randn(1, 896, dtype=torch.bfloat16, device="cuda")
    weight = (torch.randn(151936, 896, device="cuda") / 30).to(torch.bfloat16)
    logits = cuda_ops.logits(hidden, weight)
    assert logits.dtype == torch.float32 and logits.shape == (1, 151936)
    exact = hidden.double() @ weight.double().T
    # bf16 products are exact in float32; only the float32 summation order is left
    torch.testing.assert_close(logits.double(), exact, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits, TorchOps().logits(hidden, weight), rtol=0, atol=1e-5)


def test_inputs_outside_the_kernel_fall_back_to_the_reference(cuda_ops):
    w = torch.randn(64, 40, dtype=torch.bfloat16, device="cuda")
    for x in (
        torch.randn(2, 40, dtype=torch.bfloat16, device="cuda"),  # more than one row: cuBLAS
        torch.randn(1, 41, dtype=torch.bfloat16, device="cuda")[:, 1:],  # a row not 16-byte aligned
    ):
        torch.testing.assert_close(cuda_ops.linear(x, w), F.linear(x, w), rtol=0, atol=0)
    x32 = torch.randn(1, 40, device="cuda")
    torch.testing.assert_close(cuda_ops.linear(x32, w.float()), F.linear(x32, w.float()), rtol=0, atol=0)


def test_linear_replays_in_a_cuda_graph(cuda_ops):
    x = torch.randn(1, 896, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(1152, 896, dtype=torch.bfloat16, device="cuda")
    expected = cuda_ops.linear(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_ops.linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, cuda_ops.linear(x, w), rtol=0, atol=0)
    assert not torch.equal(out, expected)
