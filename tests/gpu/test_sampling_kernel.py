"""The Gumbel-max sampling kernel against the torch reference on the same GPU: the same tokens."""
import pytest
import torch
from kv_utils import requires_cuda

from rollout_service.ops.random import gumbel, row_key, vocab_ids
from rollout_service.engine.sampler import Sampler
from rollout_service.engine.sequence import Sequence
from rollout_service.ops.torch_ops import TorchOps
from rollout_service.types import SamplingParams

pytestmark = pytest.mark.skipif(**requires_cuda)


def _keys(batch: int, step: int = 17) -> torch.Tensor:
    return torch.tensor([row_key(1234 + b, b % 3, step) for b in range(batch)], device="cuda")


# (1, 151936): 75 chunks and the combine launch; (256, 151936): 2 chunks; (3, 100): one chunk per row
@pytest.mark.parametrize("batch,vocab", [(1, 151_936), (7, 32_001), (256, 151_936), (3, 100)])
def test_gumbel_argmax_matches_the_reference(cuda_ops, batch, vocab):
    # small logits: the noise decides, so every token of the row competes and a wrong draw would show
    x = torch.randn(batch, vocab, device="cuda") * 0.05
    keys = _keys(batch)
    want = TorchOps().gumbel_argmax(x, keys)
    got = cuda_ops.gumbel_argmax(x, keys)
    assert got.dtype == torch.int64 and got.shape == (batch,)
    assert torch.equal(got, want), f"rows differ: {(got != want).nonzero().flatten().tolist()}"


def test_gumbel_argmax_peaked_truncated_strided_rows(cuda_ops):
    """Rows with -inf (truncated) tokens, peaked rows, a row stride wider than the vocabulary."""
    wide = torch.randn(64, 50_000, device="cuda") * 4
    x = wide[:, :49_999]
    x[::3, 100:] = float("-inf")  # top-k-like truncation
    x[1::3, 7] += 30.0            # the noise cannot beat this
    keys = _keys(64, step=3)
    got = cuda_ops.gumbel_argmax(x, keys)
    assert torch.equal(got, (x + gumbel(keys, vocab_ids(x.shape[1], "cuda"))).argmax(dim=1))
    assert bool((got[1::3] == 7).all()) and bool((got[::3] < 100).all())


def test_gumbel_argmax_nan_and_ties_follow_torch_argmax(cuda_ops):
    x = torch.randn(4, 10_000, device="cuda")
    x[0, 4321] = float("nan")
    x[1, 10] = x[1, 9000] = float("nan")  # the first NaN wins
    x[2] = float("-inf")                   # every draw -inf: argmax says 0
    keys = _keys(4)
    got = cuda_ops.gumbel_argmax(x, keys)
    assert got[:3].tolist() == [4321, 10, 0]
    assert torch.equal(got, TorchOps().gumbel_argmax(x, keys))


def test_gumbel_argmax_bad_input_falls_back_to_the_reference(cuda_ops):
    x = torch.randn(3, 1000, device="cuda", dtype=torch.float64)  # not float32: the torch reference draws
    keys = _keys(3)
    assert torch.equal(cuda_ops.gumbel_argmax(x, keys), TorchOps().gumbel_argmax(x, keys))


def test_sampler_on_cuda_ops_draws_the_cpu_tokens(cuda_ops):
    """The engine's sampler with the CUDA backend: temperature, truncation and greedy rows give the CPU
    reference's tokens and log-probs."""
    kinds = [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=0.0), dict(top_p=0.9),
             dict(temperature=1.3, logprobs=2, logprobs_mode="processed")]
    seqs = []
    for s in range(40):
        seq = Sequence(f"r{s}", [1, 2, 3], SamplingParams(max_tokens=8, **kinds[s % len(kinds)]), seed=s,
                       sample_index=s % 4)
        seqs.append(seq)
    logits = torch.randn(40, 151_936) * 2
    cpu = Sampler()(logits, seqs)
    gpu = Sampler(cuda_ops)(logits.cuda(), seqs)
    assert torch.equal(cpu.token_ids, gpu.token_ids.cpu())
    torch.testing.assert_close(cpu.logprobs, gpu.logprobs.cpu(), rtol=1e-4, atol=1e-4)
