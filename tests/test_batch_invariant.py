"""Batch-invariant mode: a sequence's tokens and log-prob bytes do not depend on its batch mates, on how its
prompt was prefilled (alone, chunked, shared, from the prefix cache) or on a preemption and recompute, and
the learner's InvariantForward recomputes the same bytes (EngineConfig.batch_invariant)."""
from unittest.mock import patch

import pytest
import torch
from engine_waves import serve_in_waves
from numerics import assert_as_close_as_the_reference, float64_copy
from tiny_models import tiny_hf_model

from rollout_service.config import EngineConfig
from rollout_service.engine.engine import Engine
from rollout_service.ops import cpu_linear, invariant
from rollout_service.training.invariant_forward import InvariantForward
from rollout_service.api.types import SamplingParams

SAMPLED = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=11, logprobs_mode="scaled")
TARGET = list(range(3, 44))  # 41 tokens: crosses a 16-row tile and a partial page


@pytest.fixture(scope="module")
def model():
    return tiny_hf_model("llama", num_hidden_layers=2)


def _prompts(n: int, seed: int, longest: int = 90) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, longest, (n,), generator=g).tolist()
    return [torch.randint(0, 256, (k,), generator=g).tolist() for k in lens]


def run(model, requests: list[tuple[list[int], SamplingParams]], then=(), **config) -> dict:
    """{(request index, sample index): result} of one engine serving `requests` together, then (once they
    are done) the requests of `then`, numbered on from the first ones."""
    eng = Engine(model_source=model, device="cpu", num_pages=config.pop("num_pages", 512), batch_invariant=True,
                 **config)
    return serve_in_waves(eng, requests, then)


def same_bytes(a, b) -> bool:
    return a.token_ids == b.token_ids and a.logprobs.tobytes() == b.logprobs.tobytes()


@pytest.fixture(scope="module")
def alone(model):
    return run(model, [(TARGET, SAMPLED)])[(0, 0)]


@pytest.mark.parametrize("mates,seed", [(1, 0), (3, 1), (12, 2)])
def test_same_bytes_in_batches_of_any_size_and_composition(model, alone, mates, seed):
    greedy = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    others = [(p, SAMPLED if i % 2 else greedy) for i, p in enumerate(_prompts(mates, seed))]
    batch = others[: mates // 2] + [(TARGET, SAMPLED)] + others[mates // 2:]  # the target mid-batch
    got = run(model, batch)[(mates // 2, 0)]
    assert same_bytes(got, alone)


def test_same_bytes_after_preemption_and_recompute(model, alone):
    """A pool too small for the batch: sequences are preempted and recomputed by prefill."""
    requests = [(p, SAMPLED) for p in _prompts(5, 3, longest=40)] + [(TARGET, SAMPLED)]
    got = run(model, requests, num_pages=14, page_size=8)
    assert got["stats"]["recomputes"] > 0
    assert same_bytes(got[(5, 0)], alone)


def test_same_bytes_with_chunked_prefill_and_without_overlap(model, alone):
    got = run(model, [(TARGET, SAMPLED)], max_num_batched_tokens=16, overlap_decode=False)
    assert same_bytes(got[(0, 0)], alone)


def test_same_bytes_with_and_without_prompt_sharing(model):
    """The n samples of a group share the prompt's pages, and a repeat of the prompt hits the prefix cache:
    each sample's bytes equal the same sample computed with the cache off."""
    group = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=5, n=4, logprobs_mode="scaled")
    prompt = TARGET + TARGET  # 82 tokens: several full pages to share
    shared = run(model, [(prompt, group)], then=[(prompt, group)])
    assert shared["stats"]["prefix_cache"]["hit_tokens"] > 0
    unshared = run(model, [(prompt, group)], enable_prefix_cache=False)
    for k in range(4):
        assert same_bytes(shared[(0, k)], unshared[(0, k)]) and same_bytes(shared[(1, k)], unshared[(0, k)])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_learner_recompute_equals_rollout_bytes(arch, temperature):
    policy = tiny_hf_model(arch, num_hidden_layers=2)
    sp = SamplingParams(temperature=temperature, max_tokens=16, ignore_eos=True, seed=3, n=2,
                        logprobs_mode="scaled")
    results = [r for k, r in run(policy, [(p, sp) for p in _prompts(4, 7)]).items() if k != "stats"]
    with torch.no_grad():
        recomputed = InvariantForward(policy).logprobs(results, temperature)
    assert all(lp.numpy().tobytes() == r.logprobs.tobytes() for lp, r in zip(recomputed, results))


def test_same_bytes_alone_and_in_a_batch_with_a_large_vocabulary(smollm2):
    """49152 logits a row: torch's logsumexp would sum a lone row across threads in another order than the
    same row inside a batch (the sampler's normaliser is a row-tile product here)."""
    policy, _ = smollm2
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, policy.config.vocab_size, (128,), generator=g).tolist() for _ in range(4)]
    for sp in (SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
               SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=4, logprobs_mode="scaled")):
        batched = run(policy, [(p, sp) for p in prompts])
        # prompt 0 alone is the run that showed the bug (its last log-prob moved by 2e-6; prompt 1 never did)
        assert same_bytes(run(policy, [(prompts[0], sp)])[(0, 0)], batched[(0, 0)])


def test_invariant_logsumexp_special_values_and_accuracy():
    x = torch.randn(5, 3000) * 4
    x[1, 7] = float("nan")
    x[2, 9] = float("inf")
    x[3] = float("-inf")
    got, ref = invariant.logsumexp(x), x.logsumexp(dim=1)
    assert torch.isnan(got[1]) and got[2] == float("inf") and got[3] == float("-inf")
    torch.testing.assert_close(got[[0, 4]], ref[[0, 4]], rtol=1e-6, atol=1e-6)
    assert torch.equal(invariant.logsumexp(x[:1]), got[:1])  # a lone row: the same bits as in the batch


def test_learner_recompute_equals_rollout_bytes_on_the_embedded_model(smollm2):
    policy, tok = smollm2
    prompts = [tok.encode(t) for t in ("The capital of France is", "Write a haiku about rain.",
                                       "1 + 1 =", "List three colours:")]
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=1, n=2, logprobs_mode="scaled")
    results = [r for k, r in run(policy, [(p, sp) for p in prompts]).items() if k != "stats"]
    with torch.no_grad():
        recomputed = InvariantForward(policy).logprobs(results)
    assert all(lp.numpy().tobytes() == r.logprobs.tobytes() for lp, r in zip(recomputed, results))


def test_invariant_products_match_the_reference_closely():
    """Row tiles change the summation kernel, not the math: within float32 rounding of F.linear."""
    x, w, b = torch.randn(37, 96), torch.randn(80, 96), torch.randn(80)
    torch.testing.assert_close(invariant.linear(x, w, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    tiles = [invariant.linear(x[i:i + 1], w, b) for i in range(3)]
    assert all(torch.equal(t[0], invariant.linear(x, w, b)[i]) for i, t in enumerate(tiles))


def test_block_attention_matches_the_reference_closely():
    from rollout_service.ops.invariant import InvariantOps
    from rollout_service.ops.rope import build_cos_sin_cache
    from rollout_service.training.invariant_forward import reference_self_attention
    cos_sin = build_cos_sin_cache(tiny_hf_model("llama").config, 256)[:, :16]
    lens = [1, 70, 130]
    q, k, v = torch.randn(sum(lens), 4, 16), torch.randn(sum(lens), 2, 16), torch.randn(sum(lens), 2, 16)
    got = InvariantOps().causal_self_attention(q, k, v, cos_sin, lens, 0.25)
    torch.testing.assert_close(got, reference_self_attention(q, k, v, cos_sin, lens, 0.25), rtol=1e-5, atol=1e-5)


def test_config_takes_either_backend_and_refuses_non_bools():
    assert EngineConfig(batch_invariant=True, backend="cuda").backend == "cuda"  # ops/invariant_cuda.py
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(batch_invariant="yes")
    assert EngineConfig.from_dict({"batch_invariant": True}).batch_invariant is True


def test_gradients_match_the_reference_forward():
    """InvariantForward's backward is the reference math: its gradients are as close to a float64 computation
    as those of the same computation through the transformers forward (tests/numerics.py)."""
    from rollout_service.training.mismatch import token_logprobs
    policy = tiny_hf_model("qwen2", num_hidden_layers=2)
    sp = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=2, logprobs_mode="scaled")
    results = [r for k, r in run(policy, [(p, sp) for p in _prompts(3, 9)]).items() if k != "stats"]
    exact_policy = float64_copy(policy)

    def grads(model, fn):
        model.zero_grad()
        loss = sum(lp.sum() for lp in fn())
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    ours = grads(policy, lambda: InvariantForward(policy).logprobs(results))
    ref = grads(policy, lambda: token_logprobs(policy, results))
    exact = grads(exact_policy, lambda: token_logprobs(exact_policy, results))
    for (name, _), a, b, e in zip(policy.named_parameters(), ours, ref, exact):
        assert_as_close_as_the_reference(a, b, e, name)


# ---- the cuda backend's invariant ops: the host-side parts that run anywhere (tests/gpu runs the kernels) ----

def test_cuda_invariant_products_use_one_gemm_shape_whatever_the_rows():
    from rollout_service.ops.invariant_cuda import GEMM_ROWS, _fixed_row_chunks
    w = torch.randn(24, 40)
    for rows in (1, 7, GEMM_ROWS, GEMM_ROWS + 3, 3 * GEMM_ROWS):
        x, shapes = torch.randn(rows, 40), []

        def product(chunk):
            shapes.append(tuple(chunk.shape))
            return chunk @ w.t()
        out = _fixed_row_chunks(x, product)
        assert set(shapes) == {(GEMM_ROWS, 40)} and len(shapes) == -(-rows // GEMM_ROWS)
        torch.testing.assert_close(out, x @ w.t())
    strided = torch.randn(10, 80)[:, ::2]  # not contiguous: copied into an aligned, padded block first
    torch.testing.assert_close(_fixed_row_chunks(strided, lambda c: c @ w.t()), strided @ w.t())


def test_cuda_invariant_prefill_queries_become_one_decode_row_each():
    """Query at position p of a (possibly chunked) prefill reads its sequence's first p // 16 + 1 pages."""
    from rollout_service.ops.attention import make_metadata
    from rollout_service.ops.invariant_cuda import per_query_pages
    tables = [[5, 9], [3], [7, 2, 11, 4]]
    q_lens, kv_lens = [20, 3, 10], [20, 3, 60]  # the third: a later chunk (positions 50..59)
    meta = make_metadata(tables, q_lens, kv_lens, 16, True)
    indptr, indices, last = per_query_pages(meta, 16)
    expected = [(table, pos) for table, q, kv in zip(tables, q_lens, kv_lens) for pos in range(kv - q, kv)]
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32 and len(indptr) == len(expected) + 1
    for i, (table, pos) in enumerate(expected):
        assert indices[indptr[i]:indptr[i + 1]].tolist() == table[:pos // 16 + 1]
        assert last[i] == pos % 16 + 1


def test_cuda_invariant_mode_names_what_it_does_not_cover():
    from transformers import LlamaConfig

    from rollout_service.ops.invariant_cuda import CudaInvariantOps
    CudaInvariantOps.check_model(LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2),
                                 torch.bfloat16, 16)
    odd = LlamaConfig(hidden_size=96, num_attention_heads=4, num_key_value_heads=2)  # head_dim 24
    with pytest.raises(ValueError, match=r"dtype float32 \(needs bfloat16 or float16\), head_dim 24 .*page_size 32"):
        CudaInvariantOps.check_model(odd, torch.float32, 32)


@pytest.mark.parametrize("product", [invariant.matmul_t, cpu_linear.linear], ids=["blas", "onednn"])
def test_products_have_the_bits_of_row_tile_products_on_either_path(product):
    """tiled_product folds the tiles into one product only where that gives each row a 16-row product's bits."""
    x, w = torch.randn(100, 96), torch.randn(80, 96)
    with torch.inference_mode():
        tiles = torch.cat([product(t, w) for t in invariant._row_tiles(x)])[:100]
        key = (product, tuple(w.shape), w.dtype, "cpu")
        assert invariant._fold_ok(w, product) in (True, False) and key in invariant._fold_checked
        assert torch.equal(invariant.tiled_product(x, w, product), tiles)
        folded = invariant._fold_checked[key]
        try:
            invariant._fold_checked[key] = False  # one product per tile: the same bits (as the check said)
            assert torch.equal(invariant.tiled_product(x, w, product), tiles)
        finally:
            invariant._fold_checked[key] = folded


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (16, 1)])
def test_attention_gives_the_same_bits_on_either_path_and_matches_the_reference(heads):
    """A sequence's tiles stacked into one product (keys in place) or one product per tile (keys copied per
    tile): the same bits, and a query's bits do not depend on its batch mates (a sequence with no queries this
    step, other lengths). Within float32 rounding of plain causal attention."""
    hq, hk = heads
    q_lens, kv_lens = [17, 0, 30, 40], [17, 4, 70, 130]
    q = torch.randn(sum(q_lens), hq, 16)
    keys, values = torch.randn(4, hk, 130, 16), torch.randn(4, hk, 130, 16)
    keys[:2, :, 17:] = values[:2, :, 17:] = float("nan")  # past a sequence's length: anything
    got = invariant.block_attention_forward(q, keys, values, q_lens, kv_lens, 0.25)
    queries, _ = invariant._queries_per_tile(hq // hk, 16, torch.device("cpu"))
    # the same tiles, one product each (where the check refused stacking, both runs take that path)
    with patch.object(invariant, "_queries_per_tile", lambda *_: (queries, False)):
        assert torch.equal(invariant.block_attention_forward(q, keys, values, q_lens, kv_lens, 0.25), got)
    alone = invariant.block_attention_forward(q[17:47], keys[2:3], values[2:3], [30], [70], 0.25)
    assert torch.equal(alone, got[17:47])
    start, ref = 0, []
    for b, (n, kv) in enumerate(zip(q_lens, kv_lens)):
        visible = torch.arange(kv)[None, :] <= torch.arange(kv - n, kv)[:, None]
        ref.append(torch.nn.functional.scaled_dot_product_attention(
            q[start:start + n].transpose(0, 1), keys[b, :, :kv], values[b, :, :kv], attn_mask=visible, scale=0.25,
            enable_gqa=hq != hk).transpose(0, 1))
        start += n
    torch.testing.assert_close(got, torch.cat(ref), rtol=1e-5, atol=1e-5)
