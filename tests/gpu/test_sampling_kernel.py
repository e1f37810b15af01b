"""The Gumbel-max sampling kernel against the torch reference on the same GPU: the same tokens."""
import pytest
import torch
from kv_utils import requires_cuda

from rollout_service.ops.random import gumbel, row_key, vocab_ids
from rollout_service.engine.sampler import Sampler
from rollout_service.engine.sequence import Sequence
from rollout_service.ops.torch_ops import TorchOps
from rollout_service.api.types import SamplingParams

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


# ---- argmax_logsumexp: torch's x.max(dim=1) and x.logsumexp(dim=1) in one pass ----------------------

def _assert_argmax_lse(x: torch.Tensor, got) -> None:
    """Tokens and values exactly torch's x.max(dim=1); lse within float32 summation-order error of torch's."""
    tokens, values, lse = got
    want_values, want_tokens = x.max(dim=1)
    want_lse = x.logsumexp(dim=1)
    assert tokens.dtype == torch.int64 and values.dtype == lse.dtype == torch.float32
    assert tokens.shape == values.shape == lse.shape == x.shape[:1]
    assert torch.equal(tokens, want_tokens), f"rows differ: {(tokens != want_tokens).nonzero().flatten().tolist()}"
    # values[b] is x[b, tokens[b]] bit for bit (a -0 stays -0, a NaN keeps its payload)
    assert torch.equal(values.view(torch.int32), x.gather(1, tokens[:, None]).squeeze(1).view(torch.int32))
    torch.testing.assert_close(values, want_values, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(lse, want_lse, rtol=2e-6, atol=2e-6, equal_nan=True)


# 1000: one chunk, a short last quad; 128256 / 151936: several chunks and the combine launch
@pytest.mark.parametrize("batch", [1, 3, 256])
@pytest.mark.parametrize("vocab", [1000, 32_000, 151_936, 128_256])
def test_argmax_logsumexp_matches_torch(cuda_ops, batch, vocab):
    x = torch.randn(batch, vocab, device="cuda") * 3
    _assert_argmax_lse(x, cuda_ops.argmax_logsumexp(x))


def test_argmax_logsumexp_special_values_follow_torch(cuda_ops):
    inf, nan = float("inf"), float("nan")
    x = torch.randn(10, 20_001, device="cuda")
    x[0, 4321] = nan
    x[1, 10] = x[1, 19_000] = nan          # the first NaN wins the argmax
    x[1, 3] = inf                          # NaN beats +inf: lse NaN
    x[2, 100] = x[2, 17_000] = inf         # lse +inf, first +inf wins
    x[3] = -inf                            # lse -inf, token 0
    x[4, :9000] = -inf                     # -inf in the first chunk only
    x[5] = 2.5                             # ties everywhere: token 0
    x[6, 17] = x[6, 9000] = x[6, 20_000] = 40.0  # ties across chunks: the first wins
    x[7] = 0.0
    x[7, 0] = -0.0                         # -0 == +0: token 0, its value -0
    x[8, 20_000] = inf                     # a +inf in the row's last token
    x[9] = -inf
    x[9, 20_000] = 1.0                     # the only finite token is the last one
    got = cuda_ops.argmax_logsumexp(x)
    _assert_argmax_lse(x, got)
    tokens, values, lse = got
    assert tokens.tolist() == [4321, 10, 100, 0, x[4].argmax().item(), 0, 17, 0, 20_000, 20_000]
    assert bool(values[7].signbit())
    assert lse[:4].isnan().tolist() == [True, True, False, False]
    assert lse[2].item() == inf and lse[3].item() == -inf and lse[8].item() == inf and lse[9].item() == 1.0


def test_argmax_logsumexp_large_offsets_and_peaks(cuda_ops):
    """Logits near 1e4 (lse must subtract the max first) and rows dominated by one token."""
    x = torch.randn(8, 128_256, device="cuda") + 1e4
    x[4:, 77_777] += 100.0
    got = cuda_ops.argmax_logsumexp(x)
    _assert_argmax_lse(x, got)
    assert got[0][4:].tolist() == [77_777] * 4


def test_argmax_logsumexp_strided_and_misaligned_rows(cuda_ops):
    """Rows a slice of a wider tensor: an odd row stride, and a start that is not 16-byte aligned."""
    wide = torch.randn(64, 50_001, device="cuda") * 2
    for x in (wide[:, :49_999], wide[:, 1:50_000], wide[:, 3:]):
        assert x.stride(1) == 1 and x.stride(0) == 50_001
        _assert_argmax_lse(x, cuda_ops.argmax_logsumexp(x))


def test_argmax_logsumexp_is_batch_invariant(cuda_ops):
    """A row's (token, value, lse) are bitwise the same alone, at any position of a batch of 64, and copied to
    an aligned tensor of its own (the chunking depends on the vocabulary only)."""
    vocab = 151_936
    batch = (torch.randn(64, vocab + 3, device="cuda") * 4)[:, 1:vocab + 1]  # rows at every alignment
    assert batch.stride(0) == vocab + 3
    tokens, values, lse = cuda_ops.argmax_logsumexp(batch)
    for b in (0, 1, 2, 3, 37, 63):
        for row in (batch[b:b + 1], batch[b:b + 1].clone()):
            t, v, s = cuda_ops.argmax_logsumexp(row)
            assert t.item() == tokens[b].item() and torch.equal(v, values[b:b + 1]) and torch.equal(s, lse[b:b + 1])


def test_argmax_logsumexp_bad_input_falls_back_to_the_reference(cuda_ops):
    for x in (torch.randn(3, 1000, device="cuda", dtype=torch.float64),  # not float32
              torch.randn(1000, 3, device="cuda").t()):                  # vocabulary not contiguous
        got = cuda_ops.argmax_logsumexp(x)
        want = TorchOps().argmax_logsumexp(x)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_argmax_logsumexp_empty_batch(cuda_ops):
    tokens, values, lse = cuda_ops.argmax_logsumexp(torch.empty(0, 128_256, device="cuda"))
    assert tokens.shape == values.shape == lse.shape == (0,) and tokens.dtype == torch.int64


def test_plain_greedy_sampler_on_cuda_ops_matches_the_cpu(cuda_ops):
    seqs = [Sequence(f"r{s}", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0), seed=s) for s in range(48)]
    logits = torch.randn(48, 128_256) * 3
    cpu = Sampler()(logits, seqs)
    gpu = Sampler(cuda_ops)(logits.cuda(), seqs)
    assert torch.equal(cpu.token_ids, gpu.token_ids.cpu())
    torch.testing.assert_close(cpu.logprobs, gpu.logprobs.cpu(), rtol=1e-5, atol=1e-5)
