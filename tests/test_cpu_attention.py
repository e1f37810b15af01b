"""The CPU attention kernel (csrc/cpu_attention.c) vs dense float64 attention, its build and its
choice by the torch ops."""
import logging

import pytest
import torch

from rollout_service.ops import cpu_attention, cpu_ext, select_ops
from rollout_service.ops.attention import make_metadata, paged_attention, write_kv
from test_ops import dense_attention


def paged_case(lens, heads, dim, page_size, shared_pages=0, seed=0):
    """(q, kv, meta, ks, vs): a decode step of rows with `lens` keys in shuffled pages of a cache whose unwritten
    slots hold NaN (they must never leak); the rows share their first `shared_pages` pages."""
    gen = torch.Generator().manual_seed(seed)
    hq, hk = heads
    num_pages = sum(-(-n // page_size) for n in lens) + 3
    kv = torch.full((num_pages, 2, hk, page_size, dim), float("nan"))
    perm = iter(torch.randperm(num_pages, generator=gen).tolist())
    common = [next(perm) for _ in range(shared_pages)]
    shared_k = torch.randn(shared_pages * page_size, hk, dim, generator=gen)
    shared_v = torch.randn(shared_pages * page_size, hk, dim, generator=gen)
    tables, ks, vs = [], [], []
    for n in lens:
        tables.append(common + [next(perm) for _ in range(-(-n // page_size) - shared_pages)])
        k, v = torch.randn(n, hk, dim, generator=gen), torch.randn(n, hk, dim, generator=gen)
        k[:shared_pages * page_size], v[:shared_pages * page_size] = shared_k, shared_v
        write_kv(kv, k, v, make_metadata([tables[-1]], [n], [n], page_size).slot_mapping)
        ks.append(k)
        vs.append(v)
    q = torch.randn(len(lens), hq, dim, generator=gen)
    return q, kv, make_metadata(tables, [1] * len(lens), lens, page_size), ks, vs


CASES = {  # lens, (q heads, kv heads), head dim, page size, shared pages
    "vector, SmolLM2 shapes": ([1, 15, 16, 17, 130, 200], (9, 3), 64, 16, 0),
    "vector, head dim 128, pages of 32": ([5, 32, 33, 100], (14, 2), 128, 32, 0),
    "vector, samples sharing a prompt": ([40, 41, 57, 64], (4, 1), 64, 16, 2),
    "scalar, head dim 8, pages of 4": ([1, 3, 4, 9, 30], (4, 2), 8, 4, 0),
    "scalar, head dim 40": ([7, 16, 50], (6, 6), 40, 16, 0),
}


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_dense_float64(case):
    lens, heads, dim, page_size, shared = CASES[case]
    q, kv, meta, ks, vs = paged_case(lens, heads, dim, page_size, shared)
    assert cpu_attention.applies(q, kv), "this machine builds the CPU kernels (a C compiler with OpenMP)"
    scale = dim**-0.5
    out = cpu_attention.attention(q, kv, meta, scale)
    ref = torch.cat([dense_attention(q[i:i + 1], k, v, scale) for i, (k, v) in enumerate(zip(ks, vs))])
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("dim,page_size", [(64, 16), (8, 4)])
@pytest.mark.parametrize("q_lens,kv_lens", [([7, 1, 16, 13, 40], [7, 1, 16, 13, 40]), ([5, 3, 9, 1], [11, 4, 30, 17])])
def test_kernel_prefill_matches_dense_causal_float64(q_lens, kv_lens, dim, page_size):
    """Fresh prompts, and chunks on cached prefixes that start mid-page: each query token attends the keys up to
    its own position."""
    gen = torch.Generator().manual_seed(sum(kv_lens))
    hq, hk = 6, 2
    num_pages = sum(-(-n // page_size) for n in kv_lens) + 2
    perm = torch.randperm(num_pages, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(-(-n // page_size))] for n in kv_lens]
    kv = torch.full((num_pages, 2, hk, page_size, dim), float("nan"))
    ks = [torch.randn(n, hk, dim, generator=gen) for n in kv_lens]
    vs = [torch.randn(n, hk, dim, generator=gen) for n in kv_lens]
    write_kv(kv, torch.cat(ks), torch.cat(vs), make_metadata(tables, kv_lens, kv_lens, page_size).slot_mapping)
    qs = [torch.randn(m, hq, dim, generator=gen) for m in q_lens]
    meta = make_metadata(tables, q_lens, kv_lens, page_size)
    out = select_ops("torch").attention(torch.cat(qs), kv, meta, 0.3)
    assert out.shape == (sum(q_lens), hq, dim)
    ref = torch.cat([dense_attention(q, k, v, 0.3) for q, k, v in zip(qs, ks, vs)])
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-6)
    assert torch.equal(out, cpu_attention.attention(torch.cat(qs), kv, meta, 0.3))  # the kernel's result


def test_torch_ops_take_the_kernel_for_cpu_float32_only(monkeypatch):
    q, kv, meta, _, _ = paged_case([20, 33], (4, 2), 64, 16, seed=1)
    ops = select_ops("torch")
    assert torch.equal(ops.attention(q, kv, meta, 0.125), cpu_attention.attention(q, kv, meta, 0.125))
    assert not cpu_attention.applies(q.to(torch.bfloat16), kv.to(torch.bfloat16))  # others: the torch reference
    monkeypatch.setenv(cpu_ext.ENV, "0")
    cpu_ext.load.cache_clear()
    try:
        assert not cpu_attention.applies(q, kv)
        _, _, fresh, _, _ = paged_case([20, 33], (4, 2), 64, 16, seed=1)  # (the kernel's inputs stay in meta)
        assert torch.equal(ops.attention(q, kv, fresh, 0.125), paged_attention(q, kv, fresh, 0.125))
    finally:
        monkeypatch.delenv(cpu_ext.ENV)
        cpu_ext.load.cache_clear()


def test_lengths_past_the_tables_are_refused_not_read():
    q, kv, meta, _, _ = paged_case([20, 33], (4, 2), 64, 16)
    meta.kv_lens[1] = 49  # three pages' worth in a row that has two
    with pytest.raises(ValueError, match="row 1 would read 49 keys: outside 1..48"):
        cpu_attention.attention(q, kv, meta, 0.125)


def test_a_compiler_that_fails_leaves_the_torch_ops(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("ROLLOUT_KERNELS_CACHE", str(tmp_path))  # no earlier build to reuse
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    cpu_ext.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="rollout_service.ops.cpu_ext"):
            assert cpu_ext.load() is None
        assert "the CPU kernels did not build" in caplog.text
    finally:
        monkeypatch.undo()
        cpu_ext.load.cache_clear()
    assert cpu_ext.load() is not None


@pytest.mark.parametrize("dim", [64, 8])
def test_a_rows_bits_do_not_depend_on_its_pages_or_batch(dim):
    """What batch-invariant mode relies on (the learner lays its keys out in pages of its own): the same query
    and keys give the same bits in pages of 4, 16 or 32, alone or among other rows, as a prefill row or as a
    decode step."""
    q_all, kv, meta, ks, vs = paged_case([37, 70, 5], (6, 2), dim, 16, seed=3)
    k, v, q = ks[1], vs[1], q_all[1:2]
    want = cpu_attention.attention(q_all, kv, meta, 0.2)[1]
    for page_size in (4, 16, 32):
        lone = -(-70 // page_size)
        cache = torch.full((lone + 2, 2, 2, page_size, dim), float("nan"))
        tables = [list(range(2, 2 + lone))]
        write_kv(cache, k, v, make_metadata(tables, [70], [70], page_size).slot_mapping)
        decode = cpu_attention.attention(q, cache, make_metadata(tables, [1], [70], page_size), 0.2)
        assert torch.equal(decode[0], want), page_size
    prefill = cpu_attention.causal(torch.cat([torch.randn(69, 6, dim), q]), k, v, [70], 0.2)  # the last row
    assert torch.equal(prefill[69], want)
