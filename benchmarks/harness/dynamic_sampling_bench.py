"""WDS: dynamic sampling's overhead over plain generation (issue 17's target: <= 10% of the wasted generation).

On the in-process engine, `generate_groups` keeps `ds_groups` groups of n samples whose rewards are not
all equal. The reward (rollout_service.rewards.examples:difficulty_reward) is decided by each prompt's
metadata: "easy" prompts always 1 and "hard" always 0 (constant groups: dropped), "medium" the parity of
the sampled tokens (mixed); half of the prompts are medium. Samples are fixed-length (ignore_eos) and
seeded, so the same prompt gives the same tokens in every run, whichever way it is generated.

Timings on the same engine, with the same sampling and reward:
- T_dyn: generate_groups until the target is kept;
- T_all: plain generate of every prompt generate_groups submitted;
- T_kept: plain generate of the kept prompts only;
- T_judged: plain generate of the prompts whose groups generate_groups judged (all but those it aborted).
"WDS" (the issue's measure): overhead / wasted with wasted = T_all - T_kept and overhead = T_dyn - T_all.
Groups aborted once the target was reached count in full in T_all, so this overhead can be below zero.
"WDS judged" (stricter): the same with T_judged for T_all, so that the aborted groups' partial generation
and every gap in the pipeline count as overhead.
"""
from __future__ import annotations

import math
import time

from benchmarks.harness.context import BenchContext
from benchmarks.harness.engine_side import open_engine
from benchmarks.harness.models import random_prompts
from benchmarks.harness.report import Cell, Row

REWARD = "rollout_service.rewards.examples:difficulty_reward"
KINDS = ("easy", "medium", "hard", "medium")  # half of the groups constant
MAX_OVERSAMPLE = 4.0
MAX_SEQS = 1024  # the engine's batch: every group submitted at once fits for the default shapes' models
ROUNDS = 3       # interleaved rounds of the four timings (at least; --repeats more)


def wds_dynamic_sampling(ctx: BenchContext) -> list[Row]:
    bm, s = ctx.bm, ctx.shapes
    shape = (f"{s.ds_groups} groups kept x n={s.ds_n}, prompt {s.ds_prompt}, {s.ds_new} new, temperature 1.0, "
             "half the prompts constant")
    ratio = Row(bm.name, "WDS", f"dynamic sampling overhead / wasted generation (target <= 0.10), {shape}",
                "ratio", False)
    strict = Row(bm.name, "WDS judged", "the same against plain generate of the judged groups only (aborted "
                 "ones left out)", "ratio", False)
    seconds = Row(bm.name, "WDS time", "generate_groups to the target, s (other peer: plain generate of "
                  "every prompt it submitted)", "s", False)
    rows = [ratio, strict, seconds]
    for r in rows:
        r.hf_generate = r.hf_generate_batch = Cell.na("no HF peer for dynamic sampling")
    ratio.engine = ctx.measure(ratio, "engine", lambda: _run(ctx, ratio, strict, seconds))
    if strict.engine.note == "not run":  # (set by _run; otherwise _run failed, and ratio says why)
        strict.engine = seconds.engine = Cell.na("see the WDS row")
    return rows


def _ratio(t_dyn: float, t_all: float, t_kept: float) -> Cell:
    wasted = t_all - t_kept
    if wasted <= 0:
        return Cell.na(f"no wasted generation to compare with: {t_all:.3f} s <= T_kept {t_kept:.3f} s")
    return Cell((t_dyn - t_all) / wasted)


def _run(ctx: BenchContext, ratio: Row, strict: Row, seconds: Row) -> Cell:
    from rollout_service import SamplingParams

    bm, s = ctx.bm, ctx.shapes
    budget = math.ceil(MAX_OVERSAMPLE * s.ds_groups)
    prompts = random_prompts(budget, s.ds_prompt, bm.vocab_size, seed=17)
    meta = [{"difficulty": KINDS[i % len(KINDS)], "index": i} for i in range(budget)]
    sp = SamplingParams(n=s.ds_n, temperature=1.0, max_tokens=s.ds_new, ignore_eos=True, seed=0)
    seqs = min(budget * s.ds_n, MAX_SEQS)
    extra = {"cuda_graph_max_batch": seqs, **ctx.engine_extra}
    times: dict[str, list[float]] = {"dyn": [], "all": [], "kept": [], "judged": []}
    with open_engine(bm, ctx.backend, seqs, s.ds_prompt + s.ds_new, extra) as client:
        client.generate([p[:8] for p in prompts[:2]], sp, metadata=meta[:2], reward=REWARD)  # warm-up

        def timed(what: str, call):
            t0 = time.perf_counter()
            out = call()
            times[what].append(time.perf_counter() - t0)
            return out

        def dynamic():
            return client.generate_groups(prompts, sp, target_groups=s.ds_groups, max_oversample=MAX_OVERSAMPLE,
                                          reward=REWARD, metadata=meta)

        def plain(idx: list[int]):
            return lambda: client.generate([prompts[i] for i in idx], sp, metadata=[meta[i] for i in idx],
                                           reward=REWARD)

        res = timed("dyn", dynamic)  # its prompts are the plain runs' (later runs may submit a few more or less)
        kept = [g[0].metadata["index"] for g in res.groups]
        aborted = {r.metadata["index"] for r in res.aborted_requests}
        judged = [i for i in range(res.submitted) if i not in aborted]
        # interleaved rounds, the best time of each kept: a drift of the machine's speed hits all four alike
        for i in range(max(ROUNDS, ctx.repeats)):
            if i:
                timed("dyn", dynamic)
            everything = timed("all", plain(list(range(res.submitted))))
            timed("kept", plain(kept))
            timed("judged", plain(judged))
    t_dyn, t_all, t_kept, t_judged = (min(times[k]) for k in ("dyn", "all", "kept", "judged"))
    by_prompt = {(r.metadata["index"], r.sample_index): r.token_ids for r in everything}
    ratio.details.update(
        t_dyn_s=round(t_dyn, 4), t_all_s=round(t_all, 4), t_kept_s=round(t_kept, 4), t_judged_s=round(t_judged, 4),
        runs_s={k: [round(t, 3) for t in v] for k, v in times.items()},
        complete=res.complete, submitted=res.submitted, kept=res.kept,
        dropped=res.dropped, failed=res.failed, aborted=res.aborted, generated_tokens=res.generated_tokens,
        dropped_tokens=res.dropped_tokens, aborted_tokens=res.aborted_tokens,
        # the kept groups' tokens as plain generate makes them: the timings generate the same thing
        same_tokens=all(by_prompt[(r.metadata["index"], r.sample_index)] == r.token_ids
                        for g in res.groups for r in g))
    seconds.engine = Cell(t_dyn)
    seconds.other_peer = Cell(t_all, "plain generate of every prompt generate_groups submitted")
    if not res.complete:
        strict.engine = Cell.na("see the WDS row")
        return Cell.na(f"generate_groups kept {res.kept} of {s.ds_groups} groups ({res.reason})")
    strict.engine = _ratio(t_dyn, t_judged, t_kept)
    return _ratio(t_dyn, t_all, t_kept)
