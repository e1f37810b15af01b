"""Counter-based randomness: exact bits against a Python reference, and the quality of the uniforms."""
from __future__ import annotations

import pytest
import torch

from rollout_service.ops.random import (GOLDEN, MASK64, gumbel, random_bits, row_key, splitmix64_int,
                                           uniforms, vocab_ids)

COUNTERS = [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (2**63 - 1, 4095, 100_000), (123456789, 7, 31)]


def test_splitmix64_reference_known_values():
    # the first outputs of the splitmix64 generator seeded with 0 (published test vector)
    outs = [splitmix64_int(i * GOLDEN) for i in (1, 2, 3)]
    assert outs == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_tensor_hash_matches_python_reference_bit_for_bit():
    keys = [row_key(*c) for c in COUNTERS]
    bits = random_bits(torch.tensor(keys), vocab_ids(2000))
    for r, key in enumerate(keys):
        got = [b & MASK64 for b in bits[r].tolist()]
        want = [splitmix64_int(key + (v + 1) * GOLDEN) for v in range(2000)]
        assert got == want


def test_row_keys_are_distinct_across_counters():
    keys = {row_key(seed, 0, step) for seed in range(100) for step in range(20)}
    assert len(keys) == 100 * 20


def test_sample_k_uses_the_stream_of_seed_plus_k():
    assert all(row_key(s, k, t) == row_key(s + k, 0, t) for s in (0, 7, 2**62) for k in range(5) for t in range(3))
    assert row_key(5, 1, 0) != row_key(5, 0, 0)


def test_uniforms_are_uniform_in_open_interval():
    keys = torch.tensor([row_key(s, s % 3, s % 7) for s in range(40)])
    u = uniforms(keys, vocab_ids(25_000)).flatten().double()
    n = u.numel()
    assert uniforms(keys[:1], vocab_ids(4)).dtype == torch.float32 and n == 1_000_000
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 5 * (1 / 12) ** 0.5 / n ** 0.5
    assert abs(u.var().item() - 1 / 12) < 2e-3
    # Kolmogorov-Smirnov statistic against U(0, 1); 1.95 / sqrt(n) is the p = 0.001 bound
    s = u.sort().values
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    d = torch.maximum(grid - s, s - (grid - 1 / n)).max().item()
    assert d < 1.95 / n ** 0.5
    # neighbouring vocab ids and neighbouring rows are uncorrelated
    m = uniforms(keys, vocab_ids(25_000)).double() - 0.5
    assert abs((m[:, 1:] * m[:, :-1]).mean().item()) < 5 / 12 / n ** 0.5
    assert abs((m[1:] * m[:-1]).mean().item()) < 5 / 12 / n ** 0.5


def test_every_top_bit_is_balanced():
    bits = random_bits(torch.tensor([row_key(9, 0, t) for t in range(8)]), vocab_ids(20_000))
    hi = ((bits >> 32) & 0xFFFFFFFF).flatten()
    frac = ((hi.unsqueeze(1) >> torch.arange(32)) & 1).double().mean(0)
    assert (frac - 0.5).abs().max().item() < 0.005  # 4 standard deviations at n = 160,000


def test_gumbel_moments():
    g = gumbel(torch.tensor([row_key(s, 0, 0) for s in range(20)]), vocab_ids(25_000)).double()
    assert torch.isfinite(g).all()
    assert g.mean().item() == pytest.approx(0.5772156649, abs=0.01)  # Euler-Mascheroni
    assert g.std().item() == pytest.approx(torch.pi / 6 ** 0.5, abs=0.01)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bits_equal_cpu_bits():
    keys = torch.tensor([row_key(*c) for c in COUNTERS])
    cpu = random_bits(keys, vocab_ids(151_936))
    gpu = random_bits(keys.cuda(), vocab_ids(151_936, 'cuda')).cpu()
    assert torch.equal(cpu, gpu)
    torch.testing.assert_close(gumbel(keys.cuda(), vocab_ids(4096, 'cuda')).cpu(), gumbel(keys, vocab_ids(4096)),
                               rtol=1e-6, atol=1e-6)


def test_per_row_ids_give_the_same_bits_as_the_full_vocab():
    keys = torch.tensor([row_key(*c) for c in COUNTERS])
    full = random_bits(keys, vocab_ids(500))
    ids = torch.randint(0, 500, (len(COUNTERS), 37))
    assert torch.equal(random_bits(keys, ids), full.gather(1, ids))
