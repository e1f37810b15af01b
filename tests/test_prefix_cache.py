"""The block manager and the prefix cache (rollout_service/engine/kv_cache.py): hits, equality with the cache
off, eviction before preemption, version salting, sharing of n samples, sleep. Tiny random models; HF
transformers on the same weights is the reference where tokens are checked."""
import pytest
import torch
from tiny_models import tiny_hf_model

from rollout_service import RolloutClient, SamplingParams
from rollout_service.engine.kv_cache import BlockManager
from rollout_service.engine.sequence import Sequence

PS = 8  # page size of these tests: small, so short prompts span several pages
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=11, n=3)


@pytest.fixture(scope="module")
def llama():
    return tiny_hf_model("llama", seed=3)


def ids(k: int, seed: int, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (k,), generator=torch.Generator().manual_seed(seed)).tolist()


def client(model, **opts) -> RolloutClient:
    opts.setdefault("num_pages", 128)
    return RolloutClient.local(model, page_size=PS, **opts)


def cache(c: RolloutClient) -> dict:
    return c.engine.stats()["prefix_cache"]


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


# ---- the block manager on its own -------------------------------------------------------------------------

def seq(tokens: list[int]) -> Sequence:
    return Sequence("r", tokens, SamplingParams(), seed=0)


def test_block_manager_shares_caches_and_evicts_least_recent_first():
    copies = []
    bm = BlockManager(num_pages=9, page_size=4, copy_page=lambda s, d: copies.append((s, d)))
    a = seq(list(range(10)))  # 2 full pages + 2 tokens
    bm.grow(a, a.num_tokens)
    assert len(a.pages) == 3 and bm.num_used == 3
    a.num_computed = a.num_tokens
    child = seq(list(range(10)))
    bm.fork(a, child)  # full pages shared, the partial one copied
    assert child.pages[:2] == a.pages[:2] and child.pages[2] != a.pages[2] and copies == [(a.pages[2], child.pages[2])]
    assert bm.refcount[a.pages[0]] == 2 and bm.num_used == 4
    bm.free(child)
    bm.free(a)
    assert bm.num_used == 0 and bm.num_cached == 2 and bm.num_free == 8  # cached pages still count as free

    b = seq(list(range(8)) + [99, 98, 97])
    hits = bm.match_prefix(b)
    assert len(hits) == 2 and bm.num_idle(hits) == 2
    bm.take_prefix(b, hits)
    assert b.num_computed == 8 and bm.stats.hit_tokens == 8
    bm.grow(b, b.num_tokens)
    bm.free(b)

    other = seq(list(range(50, 58)))  # caches two more pages, released after the first two
    bm.grow(other, 8)
    other.num_computed = 8
    others = list(other.pages)
    bm.free(other)
    # take every page: the free ones first, then the cached ones, least recently used first
    order = []
    for _ in range(8):
        s = seq([1])
        bm.grow(s, 1)
        order += s.pages
    assert bm.stats.evictions == 4 and bm.num_cached == 0
    assert order[-4:] == hits + others  # the least recently released first
    with pytest.raises(RuntimeError, match="asked for 1 pages, 0 free"):
        bm.grow(seq([1]), 1)


def test_freed_pages_are_reused_before_untouched_ones():
    """A CPU engine's resident memory is the pages it has touched: 200 rounds of requests and refreshes keep
    reusing the same few (issue 45, item 5: taken from the front and freed to the back, every page of the pool
    got touched in turn)."""
    bm = BlockManager(num_pages=1000, page_size=4, copy_page=lambda s, d: None)
    touched = set()
    for version in range(1, 201):
        batch = [seq([version, i] + list(range(10))) for i in range(4)]  # 3 pages each, no prefix shared
        for s in batch:
            bm.grow(s, s.num_tokens)
            s.num_computed = s.num_tokens
            touched.update(s.pages)
        for s in batch:
            bm.free(s)  # their full pages stay cached ...
        bm.set_version(version)  # ... until a refresh makes them stale
    assert len(touched) == 12, sorted(touched)[:40]


def test_a_sequence_whose_kv_spans_a_refresh_caches_nothing_more():
    bm = BlockManager(num_pages=16, page_size=4, copy_page=lambda s, d: None)
    a = seq(list(range(12)))
    bm.grow(a, 8)
    a.num_computed = 8
    bm.cache_full_pages(a)
    assert bm.num_cached == 2
    bm.set_version(1)  # a's KV is version 0's
    bm.grow(a, 12)
    a.num_computed = 12
    bm.free(a)  # its version-0 pages are dropped, not kept for version 1
    assert bm.num_cached == 0 and bm.num_free == 15
    assert bm.match_prefix(seq(list(range(12)) + [5])) == []


# ---- the engine with the cache ---------------------------------------------------------------------------

def test_shared_prefix_hits_and_matches_the_cache_off(llama):
    system = ids(45, seed=1)
    ps = [system + ids(7 + i, seed=10 + i) for i in range(4)]
    on, off = client(llama), client(llama, enable_prefix_cache=False)
    for sp in (GREEDY, SEEDED):
        for p in ps:  # one at a time: each later prompt finds the shared system prompt cached
            a, b = on.generate([p], sp), off.generate([p], sp)
            assert [r.token_ids for r in a] == [r.token_ids for r in b]
            # float32 CPU GEMMs round a row differently for different row counts (a hit prefills fewer rows):
            # the last bits of a log-prob may move; batch-invariant numerics are their own mode
            for x, y in zip(a, b):
                assert x.logprobs.tolist() == pytest.approx(y.logprobs.tolist(), abs=1e-4)
    assert [r.token_ids for r in on.generate(ps, GREEDY)] == [hf_greedy(llama, p, 10) for p in ps]
    stats = cache(on)
    # 5 full pages of the system prompt are shared; later prompts and the repeat of each hit them
    assert stats["hit_tokens"] >= (len(ps) * 2 - 1) * 40 and 0 < stats["hit_rate"] < 1
    assert on.engine.stats()["prefilled_tokens"] < off.engine.stats()["prefilled_tokens"]
    assert cache(off) == {**cache(off), "hit_tokens": 0, "cached_pages": 0, "enabled": False}
    assert on.engine.kv.blocks.num_used == 0 and stats["cached_pages"] > 0


def test_continuation_prefills_only_the_new_tokens(llama):
    """An episode's next turn: the whole history again plus new tokens; only the new ones (and the partial
    last page of the history) are prefilled."""
    c = client(llama)
    first = c.generate([ids(37, seed=2)], GREEDY)[0]
    history = first.prompt_token_ids + first.token_ids + ids(20, seed=3)
    before = c.engine.stats()["prefilled_tokens"]
    again = c.generate([history], GREEDY)[0]
    prefilled = c.engine.stats()["prefilled_tokens"] - before
    # the sampled last token of turn 1 had no KV yet: it and the history's partial page are recomputed
    assert 20 < prefilled <= 20 + PS
    assert again.token_ids == hf_greedy(llama, history, 10)


def test_unreferenced_cached_pages_are_evicted_before_anyone_is_preempted(llama):
    c = client(llama, num_pages=1 + 24, max_num_seqs=4)
    for i in range(6):  # leaves the pool full of cached pages that nobody holds
        c.generate([ids(30, seed=20 + i)], GREEDY)
    assert cache(c)["cached_pages"] >= 20 and c.engine.kv.blocks.num_used == 0
    ps = [ids(30, seed=40 + i) for i in range(4)]  # 4 x 40 tokens = 20 pages: fits once the cache is evicted
    got = c.generate(ps, GREEDY)
    assert cache(c)["evictions"] > 0 and c.engine.stats()["preemptions"] == 0
    assert [r.token_ids for r in got] == [hf_greedy(llama, p, 10) for p in ps]


def test_preemption_and_n_samples_with_the_cache_give_the_same_tokens(llama):
    ps = [ids(21, seed=50 + i) for i in range(6)]
    sp = SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=5, n=4)
    roomy = client(llama, enable_prefix_cache=False).generate(ps, sp)
    tight = client(llama, num_pages=1 + 20)
    got = tight.generate(ps, sp)
    assert tight.engine.stats()["preemptions"] > 0, "the pool was meant to be too small"
    assert cache(tight)["hit_tokens"] > 0  # recomputes found their own pages
    assert [r.token_ids for r in got] == [r.token_ids for r in roomy]
    assert tight.engine.kv.blocks.num_used == 0


def test_a_refresh_salts_the_cache_unless_across_versions(llama):
    p = ids(40, seed=60)
    weights = {k: v.clone() for k, v in llama.state_dict().items()}
    for across, hits_after in ((False, 0), (True, 32)):
        c = client(llama, prefix_cache_across_versions=across)
        c.generate([p], GREEDY)
        assert cache(c)["cached_pages"] == 6  # 49 of its 50 tokens have KV: the prompt's and the answer's
        c.update_weights(weights, version=1)  # the same values: only the version tells old KV from new
        assert cache(c)["cached_pages"] == (6 if across else 0)
        before = cache(c)["hit_tokens"]
        after = c.generate([p], GREEDY)[0]
        assert cache(c)["hit_tokens"] - before == hits_after
        assert after.token_versions == [1] * 10


def test_sleep_forgets_the_cache_and_wake_serves_again(llama):
    c = client(llama)
    p = ids(33, seed=70)
    want = c.generate([p], GREEDY)[0].token_ids
    assert cache(c)["cached_pages"] == 5
    c.sleep(1)
    assert cache(c)["cached_pages"] == 0
    c.wake_up()
    assert c.generate([p], GREEDY)[0].token_ids == want


def test_enable_prefix_cache_must_be_a_bool(llama):
    with pytest.raises(ValueError, match="enable_prefix_cache"):
        client(llama, enable_prefix_cache="yes")


@pytest.mark.parametrize("enable", [True, False])
def test_prompts_sent_together_prefill_their_shared_system_prompt_once(llama, enable):
    """A batch of prompts behind one system prompt (a GRPO batch): the first one prefills the shared pages,
    the others wait a step and take them from the cache (with the cache off nothing waits)."""
    system = ids(5 * PS // 2, seed=40)  # 2 full pages and a half
    prompts = [system + ids(5, seed=41 + i) for i in range(4)]
    c = client(llama, enable_prefix_cache=enable)
    got = c.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    full = 2 * PS  # the shared full pages
    want = len(prompts[0]) + 3 * (len(prompts[0]) - full) if enable else 4 * len(prompts[0])
    assert c.engine.stats()["prefilled_tokens"] == want
    for p, r in zip(prompts, got):
        assert r.token_ids == hf_greedy(llama, p, 4)
    c.close()
