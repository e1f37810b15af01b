"""Tolerances derived from the reference's own rounding error, so that they hold on any CPU and BLAS build.

Two float32 computations of one quantity (ours and the reference's, e.g. InvariantForward's gradients and the
transformers forward's) differ by their rounding errors, whose size depends on the machine's kernels and
summation orders. A fixed rtol/atol tuned on one machine fails on another. Instead both are compared with a
float64 computation of the same quantity: ours passes when its error is within a few times the reference's.
"""
from __future__ import annotations

import copy

import torch

FLOAT32_EPS = torch.finfo(torch.float32).eps


def float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The same weights in float64: the 'exact' side of the comparison."""
    return copy.deepcopy(model).double()


def assert_as_close_as_the_reference(got: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor, what: str = "",
                                     factor: float = 4.0) -> None:
    """`got` and `ref`: float32 computations of what `exact` (float64) computes. Passes when the largest error
    of `got` is at most `factor` times the reference's largest error; the reference's error is floored at 4
    float32 ulps of the largest |exact| (a reference that happens to be exact must not make the bound 0)."""
    got, ref, exact = (t.detach().double() for t in (got, ref, exact))
    got_err, ref_err = (got - exact).abs().max().item(), (ref - exact).abs().max().item()
    bound = factor * max(ref_err, 4 * FLOAT32_EPS * exact.abs().max().item())
    assert got_err <= bound, (f"{what}: max error {got_err:.3e} vs float64, more than {factor:g}x the "
                              f"reference's own {ref_err:.3e}")
