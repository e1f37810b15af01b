"""RMSNorm with the residual add in one C pass (csrc/cpu_norm.c) against the torch reference and float64."""
import torch
from numerics import assert_as_close_as_the_reference

from rollout_service.ops import cpu_norm, select_ops
from rollout_service.ops.norm import add_rms_norm, rms_norm


def test_as_close_to_float64_as_the_torch_reference_and_the_same_residual():
    gen = torch.Generator().manual_seed(0)
    ops = select_ops("torch")
    for rows, hidden in ((1, 576), (33, 40), (4096, 576)):
        x, residual = torch.randn(rows, hidden, generator=gen) * 3, torch.randn(rows, hidden, generator=gen)
        weight = torch.randn(hidden, generator=gen)
        assert cpu_norm.applies(x, weight), "this machine builds the CPU kernels (a C compiler with OpenMP)"
        out, new_residual = ops.add_rms_norm(x, residual, weight, 1e-5)
        ref, ref_residual = add_rms_norm(x, residual, weight, 1e-5)
        assert torch.equal(new_residual, ref_residual)  # the add is the add
        exact = rms_norm(ref_residual.double(), weight.double(), 1e-5)
        assert_as_close_as_the_reference(out, ref, exact, f"add_rms_norm {rows}x{hidden}")
        assert_as_close_as_the_reference(ops.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5),
                                         rms_norm(x.double(), weight.double(), 1e-5), f"rms_norm {rows}x{hidden}")


def test_a_per_head_norm_of_a_strided_view_and_a_rows_bits_alone():
    """Qwen3's q/k norm takes a view of the fused product ([T, heads, D], rows 5 heads apart); a row's bits do not
    depend on the rows beside it."""
    qkv = torch.randn(9, 5 * 16, generator=torch.Generator().manual_seed(1))
    q = qkv[:, :48].view(9, 3, 16)
    weight = torch.rand(16) + 0.5
    ops = select_ops("torch")
    out = ops.rms_norm(q, weight, 1e-6)
    assert out.shape == q.shape
    assert_as_close_as_the_reference(out, rms_norm(q, weight, 1e-6), rms_norm(q.double(), weight.double(), 1e-6))
    assert torch.equal(ops.rms_norm(q[4:5, 1:2].clone(), weight, 1e-6), out[4:5, 1:2])
