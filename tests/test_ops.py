"""Torch reference ops vs independent dense computations and HF transformers' own functions."""
import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from rollout_service.ops import AttentionMetadata, resolve_backend, select_ops
from rollout_service.ops.attention import make_metadata, paged_attention, write_kv
from rollout_service.ops.norm import add_rms_norm, rms_norm
from rollout_service.ops.rope import apply_rope, build_cos_sin_cache

PAGE = 4


def dense_attention(q, k, v, scale):
    """q [q_len, Hq, D] are the last q_len of kv_len positions; k, v [kv_len, Hk, D]; float64 math."""
    q_len, kv_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    scores = scores.masked_fill(torch.arange(kv_len)[None, :] > q_pos, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def random_pages(kv_lens, num_pages, gen):
    """Disjoint, shuffled (non-contiguous) page lists covering each sequence's kv_len."""
    perm = torch.randperm(num_pages, generator=gen).tolist()
    tables = []
    for n in kv_lens:
        count = -(-n // PAGE)
        tables.append(perm[:count])
        perm = perm[count:]
    return tables


def run_paged(q_lens, kv_lens, heads=(4, 2), dim=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(sum(kv_lens) * 31 + sum(q_lens))
    hq, hk = heads
    tables = random_pages(kv_lens, 64, gen)
    # A cache full of NaN proves that unwritten slots and padded pages never leak into the result.
    kv = torch.full((64, 2, hk, PAGE, dim), float("nan"), dtype=dtype)
    ks = [torch.randn(n, hk, dim, generator=gen).to(dtype) for n in kv_lens]
    vs = [torch.randn(n, hk, dim, generator=gen).to(dtype) for n in kv_lens]
    qs = [torch.randn(m, hq, dim, generator=gen).to(dtype) for m in q_lens]
    fill = make_metadata(tables, kv_lens, kv_lens, PAGE)  # write every token, cached prefix included
    write_kv(kv, torch.cat(ks), torch.cat(vs), fill.slot_mapping)
    meta = make_metadata(tables, q_lens, kv_lens, PAGE)
    scale = dim**-0.5
    out = paged_attention(torch.cat(qs), kv, meta, scale)
    ref = torch.cat([dense_attention(q, k, v, scale) for q, k, v in zip(qs, ks, vs)])
    return out, ref


def test_write_kv_places_each_token_at_its_slot():
    torch.manual_seed(0)
    kv = torch.zeros(6, 2, 2, PAGE, 3)
    slots = torch.tensor([21, 2, 7, 12])
    k, v = torch.randn(4, 2, 3), torch.randn(4, 2, 3)
    write_kv(kv, k, v, slots)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(kv[s // PAGE, 0, :, s % PAGE], k[i])
        assert torch.equal(kv[s // PAGE, 1, :, s % PAGE], v[i])
    assert int((kv != 0).sum()) == k.numel() + v.numel()


@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (6, 1)])
def test_prefill_matches_dense_causal(heads):
    out, ref = run_paged(q_lens=[7, 1, 16, 13], kv_lens=[7, 1, 16, 13], heads=heads)
    assert out.shape == (37, heads[0], 8)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_lens,kv_lens", [([6, 6, 6], [6, 6, 6]), ([3, 3], [10, 10])])
def test_prefill_of_equal_sequences_in_one_call_matches_dense(q_lens, kv_lens):
    # sequences of one shape take one SDPA call for all of them (fresh prompts, and chunks on a cached prefix)
    out, ref = run_paged(q_lens=q_lens, kv_lens=kv_lens, heads=(6, 2))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_ops_write_kv_and_rope_reuse_per_step_tables_only_for_the_same_inputs():
    """TorchOps keeps the slot rows and the rope rows a step's layers share: a new or modified positions /
    slot tensor gets its own."""
    ops = select_ops("torch")
    gen = torch.Generator().manual_seed(3)
    cos_sin = build_cos_sin_cache(LlamaConfig(head_dim=8, hidden_size=32, num_attention_heads=4), 64)
    q, k = torch.randn(3, 4, 8, generator=gen), torch.randn(3, 2, 8, generator=gen)
    positions = torch.tensor([5, 9, 2])
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(ops.rope(q, k, positions, cos_sin),
                                                     apply_rope(q, k, positions, cos_sin)))
        positions.add_(7)  # in place: the version counter moves
    other = torch.tensor([1, 2, 3])
    assert torch.equal(ops.rope(q, k, other, cos_sin)[0], apply_rope(q, k, other, cos_sin)[0])
    for slots in (torch.tensor([21, 2, 7]), torch.tensor([3, 17, 8])):
        kv, ref = torch.zeros(6, 2, 2, PAGE, 8), torch.zeros(6, 2, 2, PAGE, 8)
        ops.write_kv(kv, k, k * 2, slots)
        write_kv(ref, k, k * 2, slots)
        assert torch.equal(kv, ref) and int((kv != 0).sum()) == 2 * k.numel()


def test_prefill_with_cached_prefix_matches_dense():
    # Chunks that start mid-page and cross page boundaries on top of cached tokens.
    out, ref = run_paged(q_lens=[5, 3, 9], kv_lens=[11, 4, 30])
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_decode_batch_of_ragged_lengths_matches_dense():
    kv_lens = [1, 4, 5, 17, 33]
    out, ref = run_paged(q_lens=[1] * 5, kv_lens=kv_lens)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


LAYOUTS = {  # (shared pages: "a", "a4" (a and one more), "b" or none; own tokens past them) per row
    "mixed": [("a", 5), ("a", 1), ("a4", 3), ("a4", 2), ("b", 0), ("b", 4), ("", 33), ("", 2)],
    "in order": [("a", 5), ("a", 1), ("b", 3), ("b", 7)],  # groups of equal size, one after another
    "in order, one row gone": [("a", 5), ("a", 1), ("b", 3)],  # a finished sample leaves a short last group
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("heads", [(4, 2), (6, 1)])
def test_decode_of_rows_sharing_prompt_pages_matches_dense(heads, layout):
    """Samples forked from one prompt share its full pages (read once per group by ops/shared_prefix.py); a row
    alone, a row without a full page and rows whose shared run ends at different pages keep their own."""
    gen = torch.Generator().manual_seed(7)
    hq, hk = heads
    dim, num_pages = 8, 64
    kv = torch.full((num_pages, 2, hk, PAGE, dim), float("nan"))  # unwritten slots and padding must not leak
    perm = iter(torch.randperm(num_pages - 1, generator=gen).add(1).tolist())  # page 0: scratch, never written
    prompt_a, prompt_b = [next(perm) for _ in range(3)], [next(perm) for _ in range(2)]
    shared = {"a": prompt_a, "a4": prompt_a + [next(perm)], "b": prompt_b, "": []}
    rows = [(shared[name], extra) for name, extra in LAYOUTS[layout]]
    tables, lens, ks, vs = [], [], [], []
    shared_k = {}
    for pages, extra in rows:
        n = len(pages) * PAGE + extra
        own = [next(perm) for _ in range(-(-n // PAGE) - len(pages))]
        tables.append(pages + own)
        lens.append(n)
        k, v = torch.randn(n, hk, dim, generator=gen), torch.randn(n, hk, dim, generator=gen)
        for i, page in enumerate(pages):  # a shared page holds the same K/V for every row
            sk, sv = shared_k.setdefault(page, (k[i * PAGE:(i + 1) * PAGE].clone(), v[i * PAGE:(i + 1) * PAGE].clone()))
            k[i * PAGE:(i + 1) * PAGE], v[i * PAGE:(i + 1) * PAGE] = sk, sv
        ks.append(k)
        vs.append(v)
        fill = make_metadata([tables[-1]], [n], [n], PAGE)
        write_kv(kv, k, v, fill.slot_mapping)
    meta = make_metadata(tables, [1] * len(rows), lens, PAGE)
    from rollout_service.ops import shared_prefix
    plan = shared_prefix.plan(meta.block_tables, meta.kv_lens, hk, PAGE)
    assert plan is not None  # the grouped path runs
    q = torch.randn(len(rows), hq, dim, generator=gen)
    ref = torch.cat([dense_attention(q[i:i + 1], k, v, 0.4) for i, (k, v) in enumerate(zip(ks, vs))])
    # the grouped torch path (where the C kernels do not build), and what the torch ops choose here
    grouped = shared_prefix.attention(q, kv, plan, 0.4, torch.float32)
    for out in (grouped, select_ops("torch").attention(q, kv, meta, 0.4)):
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_decode_path_equals_prefill_path_on_single_queries():
    gen = torch.Generator().manual_seed(1)
    q_lens, kv_lens = [1, 1, 1], [3, 9, 20]
    tables = random_pages(kv_lens, 64, gen)
    kv = torch.randn(64, 2, 2, PAGE, 8, generator=gen)
    q = torch.randn(3, 4, 8, generator=gen)
    a = paged_attention(q, kv, make_metadata(tables, q_lens, kv_lens, PAGE, is_prefill=True), 0.3)
    b = paged_attention(q, kv, make_metadata(tables, q_lens, kv_lens, PAGE, is_prefill=False), 0.3)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_bfloat16_attention_close_to_dense():
    out, ref = run_paged(q_lens=[6, 1], kv_lens=[6, 12], dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_metadata_fields_follow_contract():
    meta = make_metadata([[5, 2], [7]], [3, 1], [6, 1], PAGE)
    assert isinstance(meta, AttentionMetadata) and meta.is_prefill and meta.num_seqs == 2
    assert meta.slot_mapping.tolist() == [5 * PAGE + 3, 2 * PAGE + 0, 2 * PAGE + 1, 7 * PAGE]
    assert meta.positions.tolist() == [3, 4, 5, 0]
    assert meta.qo_indptr.tolist() == [0, 3, 4] and meta.kv_indptr.tolist() == [0, 2, 3]
    assert meta.kv_last_page_len.tolist() == [2, 1] and meta.block_tables.tolist() == [[5, 2], [7, 0]]
    assert meta.qo_indptr.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
    with pytest.raises(ValueError, match="inconsistent"):
        make_metadata([[5]], [3], [6], PAGE)


ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
}


def rope_config(params):
    return LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       max_position_embeddings=512, rope_parameters=dict(params))


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_hf(case, dtype):
    torch.manual_seed(0)
    config = rope_config(ROPE_CASES[case])
    positions = torch.tensor([0, 1, 5, 63, 64, 200, 511])
    q = torch.randn(len(positions), 4, 32).to(dtype)
    k = torch.randn(len(positions), 2, 32).to(dtype)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])  # [1, T, D] in q's dtype
    q_ref, k_ref = apply_rotary_pos_emb(q[None].transpose(1, 2), k[None].transpose(1, 2), cos, sin)
    table = build_cos_sin_cache(rope_config(ROPE_CASES[case]), dtype=dtype)
    q_out, k_out = apply_rope(q, k, positions, table)
    torch.testing.assert_close(q_out, q_ref[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_out, k_ref[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    assert not torch.equal(q_out, q)


def test_rope_table_layout_is_cos_then_sin():
    table = build_cos_sin_cache(rope_config(ROPE_CASES["default"]))
    assert table.shape == (512, 32)
    assert torch.equal(table[0, :16], torch.ones(16)) and torch.equal(table[0, 16:], torch.zeros(16))


@pytest.mark.parametrize("params", [{"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}, {"rope_type": "nope?"}])
def test_unsupported_rope_raises(params):
    config = rope_config(ROPE_CASES["default"])
    config.rope_parameters = params
    with pytest.raises(ValueError, match="rope_type"):
        build_cos_sin_cache(config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf(dtype):
    torch.manual_seed(0)
    hf = LlamaRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(48))
    hf = hf.to(dtype)
    x = (torch.randn(5, 48) * 3).to(dtype)
    torch.testing.assert_close(rms_norm(x, hf.weight, 1e-5), hf(x), atol=0, rtol=0)
    residual = torch.randn(5, 48).to(dtype)
    y, new_residual = add_rms_norm(x, residual, hf.weight, 1e-5)
    torch.testing.assert_close(new_residual, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(y, hf(x + residual), atol=0, rtol=0)


def test_backend_selection():
    ops = select_ops("torch")
    assert ops.name == "torch" and callable(ops.attention)
    assert resolve_backend("auto", "cpu") == "torch"
    assert resolve_backend("torch", "cpu") == "torch"
    with pytest.raises(ValueError, match="triton"):
        select_ops("triton")
    with pytest.raises(ValueError, match="CUDA device"):
        resolve_backend("cuda", "cpu")


def test_logits_of_half_inputs_are_float32_and_not_rounded_to_the_model_dtype():
    torch.manual_seed(0)
    hidden = torch.randn(3, 64).to(torch.bfloat16)
    weight = (torch.randn(50, 64) * 4).to(torch.bfloat16)
    logits = select_ops("torch").logits(hidden, weight)
    exact = hidden.double() @ weight.double().T
    assert logits.dtype == torch.float32
    assert (logits.double() - exact).abs().max() < 1e-4
    # a bf16 result would be off by up to half a bf16 step (~0.03 at these magnitudes)
    assert (exact.to(torch.bfloat16).double() - exact).abs().max() > 1e-2


def test_every_backend_provides_the_ops_interface_with_its_signatures():
    """ops/interface.py declares what the model, engine and sampler may call; each backend class has every
    method with the interface's parameter names (CUDA ones checked as classes: no GPU needed)."""
    import inspect

    from rollout_service.ops.cpu_ops import CpuOps
    from rollout_service.ops.cuda_ops import CudaOps
    from rollout_service.ops.interface import Ops
    from rollout_service.ops.invariant import InvariantOps
    from rollout_service.ops.invariant_cuda import CudaInvariantOps
    from rollout_service.ops.torch_ops import TorchOps

    methods = [n for n, v in vars(Ops).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert len(methods) >= 20
    for cls in (TorchOps, CpuOps, CudaOps, InvariantOps, CudaInvariantOps):
        assert isinstance(cls.name, str) and cls.name
        for name in methods:
            want = list(inspect.signature(getattr(Ops, name)).parameters)
            assert list(inspect.signature(getattr(cls, name)).parameters) == want, (cls.__name__, name)
    assert isinstance(TorchOps(), Ops)
