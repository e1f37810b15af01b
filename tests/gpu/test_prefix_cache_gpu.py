"""The prefix cache on the GPU: the "cuda" backend's kernels (prefill attention over a cached prefix, paged
decode) and the decode CUDA graphs, in bf16, against the same engine with the cache off.

With the cache on, a hit prompt prefills fewer rows, and bf16 GEMMs round a row differently for different
row counts, so greedy tokens may part at a near-tie (the near-tie rule of test_engine_gpu.py); a kernel that
read the wrong pages would part where one token clearly wins, and its log-probs would be far off."""
import numpy as np
import pytest
import torch
from kv_utils import requires_cuda
from test_engine_gpu import first_divergence, fp32_margin, small_model

from rollout_service.engine.engine import Engine
from rollout_service.api.types import RolloutRequest, SamplingParams

pytestmark = pytest.mark.skipif(**requires_cuda)

GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs_mode="raw")


def engine(model, cache: bool, **opts) -> Engine:
    opts = {"num_pages": 512, "max_num_seqs": 16, "cuda_graph_max_batch": 16, **opts}
    eng = Engine(model_source=model, backend="cuda", device="cuda", dtype="bfloat16", enable_cuda_graphs=True,
                 enable_prefix_cache=cache, **opts)
    assert eng.runner.graphs is not None, "graph capture failed"
    return eng


def run(eng: Engine, prompts: list[list[int]], sp: SamplingParams = GREEDY, tag: str = "r"):
    for i, p in enumerate(prompts):
        eng.add_request(RolloutRequest(prompt=p, sampling=sp, request_id=f"{tag}{i}"))
    return sorted(eng.run_until_done(), key=lambda r: (int(r.request_id[len(tag):]), r.sample_index))


def assert_same_up_to_near_ties(model, refs, gots) -> None:
    gaps = []
    for ref, got in zip(refs, gots):
        n = first_divergence(ref.token_ids, got.token_ids)
        if n is not None:
            margin = fp32_margin(model, ref.prompt_token_ids, ref.token_ids, n)
            assert margin < 0.1, f"{ref.request_id}: parted at step {n} where one token clearly wins ({margin:.3f})"
        gaps.append(np.abs(ref.logprobs[:n] - got.logprobs[:n]))
    assert float(np.concatenate(gaps).mean()) < 2e-2


@pytest.fixture(scope="module")
def model():
    return small_model()


def ids(k: int, seed: int) -> list[int]:
    return torch.randint(0, 2048, (k,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_shared_prefix_with_kernels_and_graphs(model):
    system = ids(300, seed=1)
    prompts = [system + ids(20 + 7 * i, seed=10 + i) for i in range(6)]
    on, off = engine(model, True), engine(model, False)
    # the first prompt alone fills the cache; the other five then run together, each hitting 18 pages
    got = run(on, prompts[:1], tag="a") + run(on, prompts[1:], tag="b")
    ref = run(off, prompts[:1], tag="a") + run(off, prompts[1:], tag="b")
    assert_same_up_to_near_ties(model, ref, got)
    stats = on.stats()
    assert stats["prefix_cache"]["hit_tokens"] >= 5 * 288
    assert stats["prefilled_tokens"] <= off.stats()["prefilled_tokens"] - 5 * 288
    assert on.kv.blocks.num_used == 0


def test_next_turn_prefills_only_new_tokens_on_the_gpu(model):
    on, off = engine(model, True), engine(model, False)
    first = run(on, [ids(200, seed=2)], tag="t")[0]
    history = first.prompt_token_ids + first.token_ids + ids(100, seed=3)
    before = on.stats()["prefilled_tokens"]
    got = run(on, [history], tag="u")
    assert on.stats()["prefilled_tokens"] - before <= 100 + 16
    assert_same_up_to_near_ties(model, run(off, [history], tag="u"), got)


def test_n_samples_and_preemption_with_the_cache_on_the_gpu(model):
    prompts = [ids(40 + 9 * i, seed=20 + i) for i in range(8)]
    sp = SamplingParams(temperature=1.0, max_tokens=96, ignore_eos=True, seed=4, n=4)
    tight = engine(model, True, num_pages=1 + 64, max_num_seqs=32, cuda_graph_max_batch=32)
    got = run(tight, prompts, sp)
    assert tight.stats()["preemptions"] > 0, "the pool was meant to be too small"
    assert len(got) == 32 and all(len(r.token_ids) == 96 for r in got)
    assert tight.stats()["prefix_cache"]["hit_tokens"] > 0
    assert np.isfinite(np.concatenate([r.logprobs for r in got])).all()
    assert tight.kv.blocks.num_used == 0


def test_refresh_drops_the_old_versions_pages_on_the_gpu(model):
    eng = engine(model, True)
    p = ids(100, seed=5)
    run(eng, [p], tag="v")
    assert eng.stats()["prefix_cache"]["cached_pages"] > 0
    weights = {k: v.detach().to("cuda", torch.bfloat16) for k, v in model.state_dict().items()}
    eng.update_weights(weights, 1)
    assert eng.stats()["prefix_cache"]["cached_pages"] == 0
    before = eng.stats()["prefix_cache"]["hit_tokens"]
    again = run(eng, [p], tag="w")[0]
    assert eng.stats()["prefix_cache"]["hit_tokens"] == before and again.token_versions == [1] * 64
