"""The greedy step's C pass (csrc/cpu_greedy.c) against torch's x.max(dim=1) and x.logsumexp(dim=1)."""
import torch

from rollout_service.ops import cpu_greedy, select_ops


def rows_with_special_values(vocab: int) -> torch.Tensor:
    x = torch.randn(7, vocab + 5, generator=torch.Generator().manual_seed(vocab)) * 6
    x[1, 3] = x[1, vocab - 2] = x[1].max() + 1  # a tie: the first index wins
    x[2, 5], x[2, 9] = float("nan"), float("inf")  # NaN is the largest, and makes the lse NaN
    x[3, vocab - 1] = float("inf")
    x[4] = float("-inf")
    x[5, :vocab] = 0.0  # every logit equal
    return x[:, :vocab]  # rows with a stride larger than the vocabulary


def test_same_tokens_and_values_as_torch_and_the_lse_within_rounding():
    for vocab in (1, 20, 3000, 49152):
        x = rows_with_special_values(vocab) if vocab > 1 else torch.randn(3, 1)
        assert cpu_greedy.applies(x), "this machine builds the CPU kernels (a C compiler with OpenMP)"
        tokens, values, lse = select_ops("torch").argmax_logsumexp(x)
        want_values, want_tokens = x.max(dim=1)
        assert torch.equal(tokens, want_tokens), vocab
        assert torch.equal(values.nan_to_num(), want_values.nan_to_num()) and torch.equal(values.isnan(),
                                                                                           want_values.isnan())
        exact = x.double().logsumexp(dim=1)
        assert torch.equal(lse.isnan(), exact.isnan()) and torch.equal(lse.isinf(), exact.isinf())
        finite = exact.isfinite()
        assert (lse.double()[finite] - exact[finite]).abs().max() <= 4e-7 * exact[finite].abs().clamp(min=1).max()


def test_a_rows_bits_do_not_depend_on_its_batch():
    x = torch.randn(32, 49152, generator=torch.Generator().manual_seed(1)) * 3
    tokens, values, lse = cpu_greedy.argmax_logsumexp(x)
    for row in (0, 17, 31):
        alone = cpu_greedy.argmax_logsumexp(x[row:row + 1].clone())
        assert (int(alone[0]), alone[1].item(), alone[2].item()) == (int(tokens[row]), values[row].item(),
                                                                     lse[row].item())
