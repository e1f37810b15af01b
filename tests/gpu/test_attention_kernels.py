"""Paged decode and ragged prefill attention kernels vs a float64 reference (and the torch Ops)."""
import pytest
import torch
from kv_utils import TOL, poison_allocator, random_paged_cache, reference_attention, rel_err, requires_cuda

from rollout_service.ops.attention import make_metadata, paged_attention

pytestmark = pytest.mark.skipif(**requires_cuda)
DTYPES = [torch.bfloat16, torch.float16]
HEADS = [(14, 2, 64), (32, 8, 128)]  # qwen2.5-0.5b, llama3-8b


def assert_graph_replays_exactly(launch, eager: torch.Tensor) -> None:
    """launch(), captured once and replayed several times, gives the eager output bit for bit."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = launch()
    for _ in range(3):
        graph.replay()
        torch.testing.assert_close(replayed, eager, rtol=0, atol=0)


def _decode(cuda_ops, dtype, hq, hk, d, kv_lens, num_splits=0):
    cache, tables = random_paged_cache(kv_lens, hk, d, dtype)
    meta = make_metadata(tables, [1] * len(kv_lens), kv_lens, 16, is_prefill=False, device="cuda")
    q = torch.randn(len(kv_lens), hq, d, dtype=dtype, device="cuda")
    scale = d**-0.5
    poison_allocator(q.numel() * 4 * 8)
    out = cuda_ops.decode_attention(q, cache, meta, scale, num_splits=num_splits)
    ref = reference_attention(q, cache, tables, [1] * len(kv_lens), kv_lens, scale)
    return out, ref, (q, cache, meta, scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,d", HEADS)
@pytest.mark.parametrize("num_splits", [0, 1, 3, 8, -1])  # -1: one warp per (sequence, kv head)
def test_decode_odd_lengths_and_page_boundaries(cuda_ops, dtype, hq, hk, d, num_splits):
    # 4097 tokens in one split: each warp walks ~65 pages, past two refills of its 32 page numbers.
    kv_lens = [1, 15, 16, 17, 33, 100, 1000, 4097]
    out, ref, _ = _decode(cuda_ops, dtype, hq, hk, d, kv_lens, num_splits)
    assert rel_err(out, ref) < TOL[dtype]
    for b in range(len(kv_lens)):  # per sequence too: a short one must not hide behind long ones
        assert rel_err(out[b], ref[b]) < TOL[dtype], f"sequence {b} (kv_len {kv_lens[b]})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,d", [(14, 2, 64), (32, 8, 128), (32, 2, 128), (8, 8, 64), (40, 8, 128)])
def test_decode_group_sizes_long_context(cuda_ops, dtype, hq, hk, d):
    out, ref, _ = _decode(cuda_ops, dtype, hq, hk, d, [5000, 2])
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize("hq,hk,d", HEADS)
def test_decode_large_batch_random_lengths(cuda_ops, dtype, hq, hk, d):
    kv_lens = torch.randint(1, 700, (70,)).tolist()
    out, ref, (q, cache, meta, scale) = _decode(cuda_ops, dtype, hq, hk, d, kv_lens)
    assert rel_err(out, ref) < TOL[dtype]
    # and the engine's torch reference agrees (it masks stale page tails itself)
    assert rel_err(out, paged_attention(q, cache, meta, scale).float()) < TOL[dtype]


@pytest.mark.parametrize("hq,hk,d", HEADS)
def test_decode_chooses_a_warp_per_head_for_many_short_sequences(cuda_ops, hq, hk, d):
    """A rollout's decode (many sequences, short contexts) runs one warp per (sequence, kv head); the last
    CTA may hold fewer than four of them."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = (3 * sms) // hk + 3  # just past the threshold; with hk = 2 the unit count is not a multiple of 4
    kv_lens = torch.randint(1, 500, (batch,)).tolist()
    out, ref, (q, cache, meta, scale) = _decode(cuda_ops, torch.bfloat16, hq, hk, d, kv_lens)
    assert cuda_ops.kernels.decode_num_splits(q, hk, meta.max_kv_len) == -1
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    worst = max(range(batch), key=lambda b: rel_err(out[b], ref[b]))
    assert rel_err(out[worst], ref[worst]) < TOL[torch.bfloat16], f"sequence {worst} (kv_len {kv_lens[worst]})"


@pytest.mark.parametrize("num_splits", [2, 7, 32, -1])
def test_decode_splits_replay_identically_in_a_graph(cuda_ops, num_splits):
    """Split partials and their reduce, captured once and replayed several times, give the eager output exactly."""
    out, ref, (q, cache, meta, scale) = _decode(cuda_ops, torch.bfloat16, 14, 2, 64, [3000, 40, 700], num_splits)
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    assert_graph_replays_exactly(lambda: cuda_ops.decode_attention(q, cache, meta, scale, num_splits=num_splits), out)


def test_decode_through_ops_attention_matches_direct_call(cuda_ops):
    out, _, (q, cache, meta, scale) = _decode(cuda_ops, torch.bfloat16, 32, 8, 128, [300, 7, 64])
    torch.testing.assert_close(cuda_ops.attention(q, cache, meta, scale), out, rtol=0, atol=0)


PREFILL_CASES = [  # (q_len, kv_len): fresh prompts, cached prefixes, 64/128-query tile and page edges
    (1, 1), (5, 5), (16, 16), (17, 40), (64, 64), (65, 200), (100, 300), (130, 131), (7, 1000), (1, 77), (250, 250),
    (128, 128), (129, 129), (256, 384), (200, 1000), (127, 255),
]
# (impl, exact P·V): the default kernel of this GPU (wgmma on Hopper) and the mma.sync one, each both ways
PREFILL_KERNELS = [("auto", False), ("auto", True), ("mma_sync", False), ("mma_sync", True)]
GQA_HEADS = [(8, 8, 64), (32, 8, 128), (28, 4, 128), (16, 2, 64)]  # group sizes 1, 4, 7, 8


def _prefill(cuda_ops, dtype, hq, hk, d, cases, impl="auto", exact=False):
    q_lens = [c[0] for c in cases]
    kv_lens = [c[1] for c in cases]
    cache, tables = random_paged_cache(kv_lens, hk, d, dtype)
    meta = make_metadata(tables, q_lens, kv_lens, 16, is_prefill=True, device="cuda")
    q = torch.randn(sum(q_lens), hq, d, dtype=dtype, device="cuda")
    scale = d**-0.5
    poison_allocator(q.numel() * 4 * 8)
    out = cuda_ops.prefill_attention(q, cache, meta, scale, exact=exact, impl=impl)
    ref = reference_attention(q, cache, tables, q_lens, kv_lens, scale)
    return out, ref, (q, cache, meta, scale)


@pytest.mark.parametrize("impl,exact", PREFILL_KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,d", GQA_HEADS)
def test_prefill_ragged_with_cached_prefix(cuda_ops, dtype, hq, hk, d, impl, exact):
    out, ref, _ = _prefill(cuda_ops, dtype, hq, hk, d, PREFILL_CASES, impl, exact)
    assert rel_err(out, ref) < TOL[dtype]
    start = 0
    for q_len, kv_len in PREFILL_CASES:
        assert rel_err(out[start : start + q_len], ref[start : start + q_len]) < TOL[dtype], (q_len, kv_len)
        start += q_len


def _share_rounded_differently(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out != ref.to(out.dtype)).float().mean().item()


@pytest.mark.parametrize("impl", ["auto", "mma_sync"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,d", [(14, 2, 64), (32, 8, 128)])
def test_prefill_exact_pv_rounds_like_float32_reference(cuda_ops, dtype, hq, hk, d, impl):
    """exact=True: the outputs differ from the float64 result rounded once about as rarely as the float32 torch
    reference's do (H200: 0.0009 vs 0.0003 in bf16, 0.0045 vs 0.0028 in fp16), where the flash-style default
    (P rounded to the dtype) differs in ~38% of them, yet stays a rounding-level difference."""
    out, ref, (q, cache, meta, scale) = _prefill(cuda_ops, dtype, hq, hk, d, [(300, 700), (129, 129)], impl, True)
    fast = cuda_ops.prefill_attention(q, cache, meta, scale, exact=False, impl=impl)
    floor = _share_rounded_differently(paged_attention(q, cache, meta, scale), ref)
    exact_share, fast_share = _share_rounded_differently(out, ref), _share_rounded_differently(fast, ref)
    print(f"share rounded differently from float64: torch {floor:.4f}, exact {exact_share:.4f}, fast {fast_share:.4f}")
    assert exact_share <= 2 * floor + 1e-3
    assert rel_err(fast, ref) < TOL[dtype]


@pytest.mark.parametrize("impl", ["auto", "mma_sync"])
def test_prefill_replays_identically_in_a_graph(cuda_ops, impl):
    out, ref, (q, cache, meta, scale) = _prefill(cuda_ops, torch.bfloat16, 32, 8, 128, [(300, 700), (5, 5)], impl)
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    assert_graph_replays_exactly(lambda: cuda_ops.prefill_attention(q, cache, meta, scale, impl=impl), out)


def test_prefill_wgmma_kernel_is_built_on_hopper(cuda_ops):
    """On an sm_90 GPU the build must carry the wgmma kernel, or every prefill silently takes the slow path."""
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert cuda_ops.kernels.prefill_sm90_available() == hopper


def test_prefill_kernels_agree_with_each_other(cuda_ops):
    """The two kernels with exact P·V compute the same sums to float32 rounding: nearly every output equal."""
    out, ref, (q, cache, meta, scale) = _prefill(cuda_ops, torch.bfloat16, 28, 4, 128, PREFILL_CASES, "auto", True)
    other = cuda_ops.prefill_attention(q, cache, meta, scale, exact=True, impl="mma_sync")
    assert (out != other).float().mean().item() < 2e-3
    assert rel_err(out, other.float()) < 1e-3


@pytest.mark.parametrize("hq,hk,d", HEADS)
def test_prefill_long_prompt_matches_torch_ops(cuda_ops, hq, hk, d):
    q_lens, kv_lens = [1500, 300], [2100, 300]
    cache, tables = random_paged_cache(kv_lens, hk, d, torch.bfloat16)
    meta = make_metadata(tables, q_lens, kv_lens, 16, is_prefill=True, device="cuda")
    q = torch.randn(sum(q_lens), hq, d, dtype=torch.bfloat16, device="cuda")
    out = cuda_ops.attention(q, cache, meta, d**-0.5)
    assert rel_err(out, reference_attention(q, cache, tables, q_lens, kv_lens, d**-0.5)) < TOL[torch.bfloat16]
    assert rel_err(out, paged_attention(q, cache, meta, d**-0.5).float()) < TOL[torch.bfloat16]


def test_unsupported_head_dim_falls_back_to_reference(cuda_ops):
    kv_lens = [40, 3]
    cache, tables = random_paged_cache(kv_lens, 2, 96, torch.bfloat16)
    meta = make_metadata(tables, [1, 1], kv_lens, 16, is_prefill=False, device="cuda")
    q = torch.randn(2, 4, 96, dtype=torch.bfloat16, device="cuda")
    out = cuda_ops.attention(q, cache, meta, 0.1)
    torch.testing.assert_close(out, paged_attention(q, cache, meta, 0.1), rtol=0, atol=0)


def test_prefill_unaligned_q_rows_take_the_mma_sync_kernel(cuda_ops):
    """q rows 4 bytes off a 16-byte boundary: the wgmma kernel's 16-byte copies do not apply, the result must not
    change (the launcher routes them to the mma.sync kernel)."""
    hq, hk, d, cases = 14, 2, 64, [(100, 300), (17, 17)]
    q_lens, kv_lens = [c[0] for c in cases], [c[1] for c in cases]
    cache, tables = random_paged_cache(kv_lens, hk, d, torch.bfloat16)
    meta = make_metadata(tables, q_lens, kv_lens, 16, is_prefill=True, device="cuda")
    rows = sum(q_lens)
    buf = torch.randn(rows * (hq * d + 2), dtype=torch.bfloat16, device="cuda")
    q = torch.as_strided(buf, (rows, hq, d), (hq * d + 2, d, 1))
    out = cuda_ops.prefill_attention(q, cache, meta, d**-0.5)
    assert rel_err(out, reference_attention(q, cache, tables, q_lens, kv_lens, d**-0.5)) < TOL[torch.bfloat16]
