"""W7: multi-turn episodes (benchmarks/README.md), the prefix cache on vs off, HF generate per turn as the peer.

Every episode: a first prompt, then `w7_turns` model turns of `w7_new` tokens (greedy, ignore_eos: fixed
lengths), each but the last followed by a `w7_obs`-token observation from SyntheticEnv. The engine runs the
episodes with RolloutClient.run_episodes, once with the prefix cache on and once off: with it on, a turn
prefills only what the model has not seen (the observation, the previous turn's last sampled token and at
most one partial page of history); off, the whole history again. The peer is HF `generate` on a padded
batch, run again for every turn on each episode's whole history, as a learner without a rollout engine would.

The bench models have no tokenizer, so the observations are token ids: seeded per episode and turn, the same
in every run and for every contender.

Rows:
- W7 prefill: tokens run through prefill per new token (the first prompts, the observations and each earlier
  turn's last sampled token, which never had KV): cache on (engine), off (other peer), HF generate (the
  whole history every turn, counted). Target with the cache on: <= 1.2.
- W7 time: seconds for all the episodes: cache on (engine), off (other peer), HF generate per turn. Target on
  the H200: cache on >= 2x faster than off.
"""
from __future__ import annotations

import random
import time

from benchmarks.harness.ceilings import sync
from benchmarks.harness.context import BenchContext
from benchmarks.harness.engine_side import open_engine
from benchmarks.harness.peers import hf_generate
from benchmarks.harness.report import Cell, Row


class SyntheticEnv:
    """An environment whose prompt and observations are seeded token ids (the same in every run): reward 0,
    never done (max_turns ends its episodes). For models without a tokenizer; picklable, so it runs through
    Ray too. `delay_s`: seconds each step takes (a slow tool)."""

    def __init__(self, seed: int, prompt_tokens: int, obs_tokens: int, vocab_size: int, delay_s: float = 0.0):
        self.seed, self.prompt_tokens, self.obs_tokens = seed, prompt_tokens, obs_tokens
        self.vocab_size, self.delay_s = vocab_size, delay_s
        self.turn = 0

    def tokens(self, turn: int) -> list[int]:
        """The prompt (turn 0) or the observation after model turn `turn`."""
        rng = random.Random(self.seed * 1_000_003 + turn)
        return [rng.randrange(self.vocab_size) for _ in range(self.obs_tokens if turn else self.prompt_tokens)]

    def reset(self, metadata) -> list[int]:
        self.turn = 0
        return self.tokens(0)

    def step(self, assistant_text: str) -> tuple[list[int], float, bool]:
        if self.delay_s:
            time.sleep(self.delay_s)
        self.turn += 1
        return self.tokens(self.turn), 0.0, False


def w7_multiturn(ctx: BenchContext) -> list[Row]:
    bm, s = ctx.bm, ctx.shapes
    shape = (f"{s.w7_episodes} episodes x {s.w7_turns} turns, prompt {s.w7_prompt}, {s.w7_obs}-token observations, "
             f"{s.w7_new}-token answers, greedy")
    prefill = Row(bm.name, "W7 prefill", f"tokens prefilled per new token, {shape} (target <= 1.2)", "x", False)
    elapsed = Row(bm.name, "W7", f"seconds for every episode, {shape}", "s", False)
    for row in (prefill, elapsed):
        row.hf_generate_batch = Cell.na("not a peer of W7")
    counts: dict[str, dict] = {}

    def engine(cache: bool) -> Cell:
        counts[cache] = _engine_run(ctx, cache)
        return Cell(counts[cache]["s"], "" if cache else "engine, prefix cache off")

    elapsed.engine = ctx.measure(elapsed, "engine", lambda: engine(True))
    elapsed.other_peer = ctx.measure(elapsed, "engine_no_prefix_cache", lambda: engine(False))
    elapsed.hf_generate = ctx.measure(elapsed, "hf_generate", lambda: _hf_run(ctx, elapsed))
    _fill_prefill(ctx, prefill, counts)
    for cache, c in counts.items():
        elapsed.details[f"cache_{'on' if cache else 'off'}"] = c
    return [prefill, elapsed]


def _envs(ctx: BenchContext) -> list[SyntheticEnv]:
    s = ctx.shapes
    return [SyntheticEnv(i, s.w7_prompt, s.w7_obs, ctx.bm.vocab_size) for i in range(s.w7_episodes)]


def _total_tokens(ctx: BenchContext) -> int:
    s = ctx.shapes
    return s.w7_prompt + s.w7_turns * s.w7_new + (s.w7_turns - 1) * s.w7_obs


def _engine_run(ctx: BenchContext, cache: bool) -> dict:
    from rollout_service import SamplingParams

    s, total = ctx.shapes, _total_tokens(ctx)
    sampling = SamplingParams(temperature=0.0, max_tokens=s.w7_new, ignore_eos=True)
    extra = {**ctx.engine_extra, "enable_prefix_cache": cache}
    with open_engine(ctx.bm, ctx.backend, s.w7_episodes, total, extra) as client:
        warm = SyntheticEnv(-1, 8, 8, ctx.bm.vocab_size)
        client.run_episodes([warm], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), 2, 32)
        before = client.stats()[0]
        sync(ctx.device)
        t0 = time.perf_counter()
        results = client.run_episodes(_envs(ctx), sampling, max_turns=s.w7_turns, max_total_tokens=total)
        sync(ctx.device)
        seconds = time.perf_counter() - t0
        after = client.stats()[0]
    bad = [(r.finish_reason, len(r.token_ids)) for r in results
           if r.finish_reason != "max_turns" or len(r.prompt_token_ids) + len(r.token_ids) != total]
    if bad:
        raise RuntimeError(f"episodes did not run to their fixed length {total}: {bad[:3]}")
    new = sum(len(r.prompt_token_ids) + r.loss_mask.count(0) + len(r.turns) - 1 for r in results)
    prefilled = after.get("prefilled_tokens")
    out = {"s": round(seconds, 3), "new_tokens": new, "turn_prompt_tokens": _turn_prompt_tokens(ctx)}
    if prefilled is None:  # an engine without the counter: the cache cannot be seen working, so assume none
        out.update(prefilled_tokens=out["turn_prompt_tokens"], prefilled_basis="no prefilled_tokens stat: assumed")
    else:
        out["prefilled_tokens"] = prefilled - before["prefilled_tokens"]
    cache_stats = after.get("prefix_cache")
    if isinstance(cache_stats, dict):
        out["prefix_cache"] = {k: cache_stats[k] for k in ("hit_rate", "hit_tokens", "cached_pages", "evictions")
                               if k in cache_stats}
    return out


def _turn_prompt_tokens(ctx: BenchContext) -> int:
    """Every turn's prompt in full, over every episode: what is prefilled without any reuse."""
    s = ctx.shapes
    per_episode = sum(s.w7_prompt + t * (s.w7_new + s.w7_obs) for t in range(s.w7_turns))
    return s.w7_episodes * per_episode


def _hf_run(ctx: BenchContext, row: Row) -> Cell:
    """HF generate on every episode's whole history, one padded batch per turn."""
    s, bm = ctx.shapes, ctx.bm
    envs = _envs(ctx)
    histories = [env.reset(None) for env in envs]
    hf_generate(bm, [h[:8] for h in histories[:2]], 2)  # warm-up
    seconds = 0.0
    for turn in range(s.w7_turns):
        run = hf_generate(bm, histories, s.w7_new)
        seconds += run.seconds
        for h, out, env in zip(histories, run.token_ids, envs):
            h += out
            if turn + 1 < s.w7_turns:
                h += env.step("")[0]
    row.details["hf_generate_prefilled_tokens"] = _turn_prompt_tokens(ctx)
    return Cell(seconds)


def _fill_prefill(ctx: BenchContext, row: Row, counts: dict) -> None:
    new = next((c["new_tokens"] for c in counts.values()), None)
    if new is None:
        row.engine = row.other_peer = row.hf_generate = Cell.na("the engine runs did not finish")
        return
    for cache, col in ((True, "engine"), (False, "other_peer")):
        c = counts.get(cache)
        setattr(row, col, Cell(c["prefilled_tokens"] / new, "" if cache else "engine, prefix cache off") if c
                else Cell.na("that engine run failed"))
    row.hf_generate = Cell(_turn_prompt_tokens(ctx) / new, "whole history every turn (counted)")
    row.details["new_tokens"] = new
