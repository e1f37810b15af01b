"""Batch-invariant mode on the cuda backend (ops/invariant_cuda.py), with CUDA graphs: a sequence's tokens and
log-prob bytes are the same alone, inside batches of any size and mix, after preemption and recompute, under
chunked prefill and prompt sharing, and equal to InvariantForward's recompute on the same bf16 weights."""
import copy

import pytest
import torch
from engine_waves import serve_in_waves
from kv_utils import requires_cuda

from rollout_service.engine.engine import Engine
from rollout_service.ops.attention import make_metadata
from rollout_service.training import InvariantForward
from rollout_service.api.types import SamplingParams

pytestmark = pytest.mark.skipif(**requires_cuda)

SAMPLED = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=11, logprobs_mode="scaled")
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
TARGET = list(range(3, 300, 2))  # 149 tokens: a partial page, and several 16-row tiles of the prefill


def hf_model(arch: str):
    import transformers

    common = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                  tie_word_embeddings=False)
    config = {"llama": lambda: transformers.LlamaConfig(**common),
              "qwen2": lambda: transformers.Qwen2Config(**common),
              "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=64)}[arch]()
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # less flat logits: sampled tokens depend on the log-probs' bits
    return model


@pytest.fixture(scope="module")
def model():
    return hf_model("llama")


def run(model, requests, then=(), **config) -> dict:
    """{(request index, sample index): result} of one cuda engine (batch_invariant, bf16, graphs) serving
    `requests` together, then those of `then`; "stats": the engine's stats."""
    config = {"num_pages": 2048, "max_num_seqs": 64, "cuda_graph_max_batch": 64, **config}
    eng = Engine(model_source=model, device="cuda", dtype="bfloat16", backend="cuda", batch_invariant=True, **config)
    out = serve_in_waves(eng, requests, then)
    out["graphs"] = eng.runner.graphs is not None
    return out


def same_bytes(a, b) -> bool:
    return list(a.token_ids) == list(b.token_ids) and a.logprobs.tobytes() == b.logprobs.tobytes()


def prompts(n: int, seed: int, longest: int = 400) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 4096, (int(k),), generator=g).tolist()
            for k in torch.randint(1, longest, (n,), generator=g)]


@pytest.fixture(scope="module")
def alone(model):
    out = run(model, [(TARGET, SAMPLED)])
    assert out["stats"]["backend"] == "cuda" and out["stats"]["batch_invariant"] and out["graphs"]
    return out[(0, 0)]


@pytest.mark.parametrize("mates,seed", [(1, 0), (6, 1), (45, 2)])
def test_same_bytes_in_batches_of_any_size_and_mix(model, alone, mates, seed):
    others = [(p, SAMPLED if i % 2 else GREEDY) for i, p in enumerate(prompts(mates, seed))]
    batch = others[:mates // 2] + [(TARGET, SAMPLED)] + others[mates // 2:]
    assert same_bytes(run(model, batch)[(mates // 2, 0)], alone)


def test_same_bytes_without_graphs_and_with_chunked_prefill(model, alone):
    eager = run(model, [(TARGET, SAMPLED)], enable_cuda_graphs=False)
    assert not eager["graphs"] and same_bytes(eager[(0, 0)], alone)
    chunked = run(model, [(p, GREEDY) for p in prompts(3, 5)] + [(TARGET, SAMPLED)], max_num_batched_tokens=64)
    assert same_bytes(chunked[(3, 0)], alone)


def test_same_bytes_after_preemption_and_recompute(model, alone):
    batch = [(p, SAMPLED) for p in prompts(12, 7, longest=300)] + [(TARGET, SAMPLED)]
    out = run(model, batch, num_pages=60, enable_prefix_cache=False)
    assert out["stats"]["preemptions"] > 0, "the pool was meant to be too small for the batch"
    assert same_bytes(out[(12, 0)], alone)


def test_shared_prompt_samples_equal_their_lone_runs(model):
    from dataclasses import replace

    group = replace(SAMPLED, n=4, seed=20)
    out = run(model, [(TARGET, group)], then=[(TARGET, group)])  # the second group hits the prefix cache
    assert out["stats"]["prefix_cache"]["hit_tokens"] > 0
    for k in range(4):
        lone = run(model, [(TARGET, replace(SAMPLED, seed=20 + k))])[(0, 0)]
        assert same_bytes(out[(0, k)], lone) and same_bytes(out[(1, k)], lone)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_learner_recompute_equals_rollout_bytes(arch):
    hf = hf_model(arch)
    batch = [(p, SAMPLED if i % 2 else GREEDY) for i, p in enumerate(prompts(9, 3))] + [(TARGET, SAMPLED)]
    out = run(hf, batch)
    results = [out[(i, 0)] for i in range(len(batch))]
    policy = copy.deepcopy(hf).to("cuda", torch.bfloat16)
    learner = InvariantForward(policy)
    assert learner.backend == "cuda"
    with torch.no_grad():
        recomputed = learner.logprobs(results)
    equal = [lp.cpu().numpy().tobytes() == r.logprobs.tobytes() for lp, r in zip(recomputed, results)]
    assert all(equal), f"{arch}: {equal}"


def test_bf16_learner_gradients_are_as_good_as_transformers_bf16(model):
    """bf16 through the kernels, backward by the reference math: every parameter's gradient is as close to the
    float32 gradient (transformers' forward on float32 weights) as transformers' own bf16 gradient is."""
    from rollout_service.training.mismatch import token_logprobs

    results = [r for k, r in run(model, [(p, SAMPLED) for p in prompts(3, 9, 120)]).items()
               if isinstance(k, tuple)]

    def grads(policy, fn):
        policy.zero_grad()
        sum(lp.float().sum() for lp in fn(policy)).backward()
        return [p.grad.float().clone() for p in policy.parameters()]

    bf16, fp32 = copy.deepcopy(model).to("cuda", torch.bfloat16), copy.deepcopy(model).to("cuda")
    ours = grads(bf16, lambda p: InvariantForward(p).logprobs(results))
    theirs = grads(bf16, lambda p: token_logprobs(p, results))
    exact = grads(fp32, lambda p: token_logprobs(p, results))
    for (name, _), a, b, ref in zip(fp32.named_parameters(), ours, theirs, exact):
        assert torch.isfinite(a).all() and a.abs().max() > 0, name
        ours_err, theirs_err = (a - ref).norm() / ref.norm(), (b - ref).norm() / ref.norm()
        assert ours_err <= 2 * theirs_err + 1e-3, f"{name}: ours {ours_err:.3g}, transformers bf16 {theirs_err:.3g}"


def test_products_and_attention_are_row_invariant_at_the_op_level():
    """The ops alone: a row's bits at M = 1, 37 and 300 (cuBLAS would pick three kernels), and a query's
    attention as a decode row equal to the same query inside a prefill."""
    from rollout_service.ops.invariant_cuda import CudaInvariantOps

    ops = CudaInvariantOps()
    x = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3072, 1024, device="cuda", dtype=torch.bfloat16) / 32
    full = ops.linear(x, w)
    for rows in (1, 37):
        assert torch.equal(ops.linear(x[:rows], w), full[:rows])
    long = torch.cat([x] * 8)  # 2400 rows: a WIDE_ROWS call where cuBLAS gives its chunks' bits, then chunks
    b = torch.randn(3072, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(ops.linear(long, w)[:300], full) and torch.equal(ops.linear(long, w)[2100:], full[:300])
    assert torch.equal(ops.linear(long, w, b)[2399], ops.linear(x[299:], w, b)[0])
    assert torch.equal(ops.logits(x[:5], w), ops.logits(x, w)[:5])
    lse = ops.logsumexp(ops.logits(x, w))
    assert torch.equal(ops.logsumexp(ops.logits(x[:1], w)), lse[:1])

    heads, kv_heads, d, n = 8, 2, 64, 70
    kv_layer = torch.randn(16, 2, kv_heads, 16, d, device="cuda", dtype=torch.bfloat16)
    pages = [3, 7, 1, 12, 5]  # 70 tokens
    q = torch.randn(n, heads, d, device="cuda", dtype=torch.bfloat16)
    prefill = ops.attention(q, kv_layer, make_metadata([pages], [n], [n], 16, True, "cuda"), 0.125)
    for pos in (0, 15, 16, 69):
        table = pages[:pos // 16 + 1]
        decode = ops.attention(q[pos:pos + 1], kv_layer, make_metadata([table], [1], [pos + 1], 16, False, "cuda"),
                               0.125)
        assert torch.equal(decode[0], prefill[pos]), pos


def test_grpo_bitwise_ratio_is_exactly_one_on_the_cuda_backend(model):
    """GRPO --bitwise against a cuda engine: the bf16 learner recomputes through the same kernels, so the PPO
    ratio of the first minibatch is exactly 1, at step 1 and after a weight update (the pushed bf16 weights are
    the learner's)."""
    import numpy as np

    pytest.importorskip("ray")  # actors.grpo imports it (the lent GPU has it from scripts/device_ray_env.sh)
    from actors.grpo import GRPOConfig, GRPOLearner
    from rollout_service import RolloutClient

    client = RolloutClient.local(model, device="cuda", dtype="bfloat16", backend="cuda", batch_invariant=True,
                                 num_pages=512, max_num_seqs=32, cuda_graph_max_batch=32)
    cfg = GRPOConfig(group_size=4, prompts_per_step=2, max_tokens=12, lr=1e-4, seed=3, temperature=1.0,
                     micro_batch=4, device="cuda", dtype="bfloat16", bitwise=True)
    learner = GRPOLearner(copy.deepcopy(model), client, cfg, prompt_fn=lambda p: [1, 2 + p, 3],
                          reward_fn=lambda r: float(np.mean([t % 2 == 0 for t in r.token_ids])))
    assert learner.invariant.backend == "cuda"
    rows = [learner.step([0, 1], full_mismatch=True), learner.step([2, 3])]
    assert rows[0]["ratio_first_minibatch_tokens"] > 0 and rows[0]["ratio_first_minibatch_max_abs_dev"] == 0.0
    assert rows[0]["mismatch_full_max"] == 0.0
    assert rows[1]["step"] == 2 and rows[1]["ratio_first_minibatch_max_abs_dev"] == 0.0
    client.close()
