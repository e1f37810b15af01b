"""WS's ceiling: how many tokens per step could a model-free drafter give on real rollouts at all?

WS (speculative_bench.py) times speculation on vs off; where it gains little, this says whether better drafting
could change that. The engine (no speculation) samples E epochs of the GRPO example's arithmetic prompts (P
prompts x n samples, temperature 1.0, up to T tokens, new seeds each epoch); then those very tokens are replayed
through drafters step by step, as a batch of every sequence of an epoch: each step, each live sequence drafts up
to k tokens from what has been seen so far, keeps the draft's tokens while they equal what it sampled, plus one
(speculation.py's rule: the tokens are plain decoding's, so a draft token is right exactly when it equals the
sampled one). Tokens per step is then the speedup a verify step would give if it cost no more than a decode step:
an upper bound on WS's on / off at that acceptance.

Drafters, all on the engine's n-gram tables (drafter._Corpus: a follower of the longest suffix seen, the one the
sequence's own Gumbel draws favour):
- "engine": drafter.py as built: suffixes of 2-4 tokens from the sequence's prompt, its own and its siblings'
  text, and earlier epochs of the same prompt, each adding the distribution its token was drawn from (the
  engine's top DIST_TOP processed log-probs of the token, as the sampler hands them to the drafter);
- "engine, counts": the same, each position adding only the token that followed (drafter.py before commit 1c1af90);
- "engine, most frequent follower": counts, the follower seen most often whatever the draws (before 2026-12-07);
- "+ every prompt": the engine's, and where that has no draft, one table of every prompt's text (phrases shared
  across tasks);
- "+ 1-token suffixes": both, and suffixes down to one token.

  python -m benchmarks.harness.draft_ceiling [--prompts 16 --n 8 --max-tokens 128 --epochs 3]
"""
from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass

import torch

from rollout_service.api.types import RolloutRequest, SamplingParams
from rollout_service.engine import drafter as drafting


@dataclass
class Shape:
    prompts: int = 16
    n: int = 8
    max_tokens: int = 128
    epochs: int = 3
    k: int = 4  # EngineConfig.num_speculative_tokens' default


# name -> (a table of every prompt where the prompt's has nothing, the shortest suffix, follow the draws,
#          add the drawn distributions)
DRAFTERS = {"engine": (False, drafting.MIN_NGRAM, True, True),
            "engine, counts": (False, drafting.MIN_NGRAM, True, False),
            "engine, most frequent follower": (False, drafting.MIN_NGRAM, False, False),
            "+ every prompt": (True, drafting.MIN_NGRAM, True, True), "+ 1-token suffixes": (True, 1, True, True)}
Sample = tuple[int, list[int], int, int, list[drafting.Dist]]  # prompt, tokens, seed, sample index, distributions


def sample(s: Shape) -> tuple[dict[int, list[int]], list[list[Sample]], float]:
    """The prompts' token ids, and per epoch each sample's (prompt, tokens, seed, sample index, the distribution
    of each token), from the engine without speculation; and the seconds sampling took."""
    from rollout_service.engine.engine import Engine

    from benchmarks.harness.models import load_bench_model
    from benchmarks.harness.speculative_bench import _prompts, _tokenizer
    bm = load_bench_model("smollm2-135m", torch.device("cpu"))
    eng = Engine(model_source=bm.hf_model, tokenizer=_tokenizer("smollm2-135m"), device="cpu", dtype="float32",
                 max_num_seqs=s.prompts * s.n, num_pages=s.prompts * s.n * (200 + s.max_tokens) // 16 + 64)
    epochs, seconds, prompt_ids = [], 0.0, {}
    for epoch in range(s.epochs):
        for i, p in enumerate(_prompts(s.prompts)):
            sp = SamplingParams(n=s.n, temperature=1.0, max_tokens=s.max_tokens, seed=1000 * epoch + i,
                                logprobs=drafting.DIST_TOP)
            eng.add_request(RolloutRequest(p, sp, request_id=str(i)))
        t0 = time.perf_counter()
        out = sorted(eng.run_until_done(), key=lambda r: (int(r.request_id), r.sample_index))
        seconds += time.perf_counter() - t0
        prompt_ids.update({int(r.request_id): list(r.prompt_token_ids) for r in out})
        epochs.append([(int(r.request_id), list(r.token_ids), 1000 * epoch + int(r.request_id), r.sample_index,
                        [(list(top), list(top.values())) for top in r.top_logprobs]) for r in out])
    return prompt_ids, epochs, seconds


class _Replay:
    """One drafter's tables across the epochs, and its counts for the epoch being replayed."""

    def __init__(self, every_prompt: bool, noise: bool = True, dists: bool = True,
                 min_ngram: int = drafting.MIN_NGRAM):
        self.every_prompt, self.noise, self.dists, self.min_ngram = every_prompt, noise, dists, min_ngram
        self.corpora: dict[int, drafting._Corpus] = {}
        self.shared = drafting._Corpus(min_ngram)

    def epoch(self, prompt_ids: dict[int, list[int]], samples: list[Sample], k: int) -> dict:
        live = []
        for prompt, tokens, seed, sample_index, dists in samples:
            corpus = self.corpora.get(prompt)
            if corpus is None:
                corpus = self.corpora[prompt] = drafting._Corpus(self.min_ngram)
                for c in (corpus, self.shared):
                    c.add(prompt_ids[prompt], 0, len(prompt_ids[prompt]) - 1)
            live.append({"corpus": corpus, "text": list(prompt_ids[prompt]), "truth": tokens, "at": 0,
                         "indexed": len(prompt_ids[prompt]) - 1, "draws": (seed, sample_index),
                         "dists": dists if self.dists else None, "prompt_len": len(prompt_ids[prompt])})
        counts = {"tokens": 0, "steps": 0, "drafts": 0, "accepted": 0, "proposed": 0}
        while live:
            for seq in live:  # one step of every live sequence, as a batch would take it
                self._step(seq, k, counts)
            live = [seq for seq in live if seq["at"] < len(seq["truth"])]
        return counts

    def _step(self, seq: dict, k: int, counts: dict) -> None:
        text, truth, at = seq["text"], seq["truth"], seq["at"]
        dists, start = seq["dists"], seq["prompt_len"] - 1
        mass = (lambda p: None) if dists is None else (lambda p: drafting.kept_mass(dists[p - start]))
        for c in (seq["corpus"], self.shared):
            c.add(text, seq["indexed"], len(text) - 1, mass)
        seq["indexed"] = max(seq["indexed"], len(text) - 1)
        room = min(k, len(truth) - at - 1)  # a draft leaves room for the token after it
        noise = drafting.sampler_noise(*seq["draws"], at) if self.noise else None  # (temperature 1: sample())
        draft = self._draft(seq["corpus"], text, room, noise) if room > 0 else []
        kept = 0
        while kept < len(draft) and draft[kept] == truth[at + kept]:
            kept += 1
        text += truth[at:at + kept + 1]
        seq["at"] = at + kept + 1
        counts["tokens"] += kept + 1
        counts["steps"] += 1
        if draft:
            counts["drafts"] += 1
            counts["accepted"] += kept
            counts["proposed"] += len(draft)

    def _draft(self, corpus: drafting._Corpus, text: list[int], k: int, noise: drafting.Noise | None) -> list[int]:
        draft = corpus.draft(text, k, noise)
        return draft if draft or not self.every_prompt else self.shared.draft(text, k, noise)


def measure(s: Shape) -> tuple[list[dict], dict]:
    prompt_ids, epochs, seconds = sample(s)
    return replay_all(prompt_ids, epochs, s.k), {"sampling_s": round(seconds, 1),
                                                 "tokens": sum(len(s[1]) for ep in epochs for s in ep)}


def replay_all(prompt_ids: dict[int, list[int]], epochs: list[list[Sample]], k: int) -> list[dict]:
    """A row per drafter and epoch."""
    rows = []
    for name, (every_prompt, min_ngram, noise, dists) in DRAFTERS.items():
        replay = _Replay(every_prompt, noise, dists, min_ngram)
        for e, samples in enumerate(epochs):
            c = replay.epoch(prompt_ids, samples, k)
            rows.append({"drafter": name, "epoch": e, "pass": "cold" if e == 0 else "warm", **c,
                         "tokens_per_step": round(c["tokens"] / c["steps"], 3),
                         "draft_share": round(c["drafts"] / c["steps"], 3),
                         "accepted_per_draft": round(c["accepted"] / max(1, c["drafts"]), 3),
                         "acceptance": round(c["accepted"] / max(1, c["proposed"]), 3)})
    return rows


def markdown(meta: dict, rows: list[dict]) -> list[str]:
    lines = [f"Shape: {meta['shape']}; the embedded SmolLM2-135M (float32, CPU) sampled every epoch without "
             f"speculation ({meta['sampled']['tokens']:,} tokens in {meta['sampled']['sampling_s']} s), the "
             "tokens then replayed through each drafter, every sequence of an epoch one step at a time. tokens / "
             "step: the speedup if a verify step cost a decode step (an upper bound); drafts: the share of steps "
             "with a draft; accepted: per draft, and per drafted token.", "",
             "| drafter | epoch | pass | tokens | steps | tokens / step | drafts | accepted per draft | "
             "acceptance |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['drafter']} | {r['epoch']} | {r['pass']} | {r['tokens']:,} | {r['steps']:,} | "
                     f"{r['tokens_per_step']:.3f} | {r['draft_share']:.2f} | {r['accepted_per_draft']:.2f} | "
                     f"{r['acceptance']:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    from benchmarks.harness.result_files import results_dir
    from benchmarks.harness.service_bench import write_results
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    for field, default in asdict(Shape()).items():
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=default)
    p.add_argument("--out", default=None)
    p.add_argument("--tag", default="", help="a label of the run, kept in its meta")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run")
    args = p.parse_args(argv)
    s = Shape(prompts=2, n=2, max_tokens=8, epochs=2) if args.quick else \
        Shape(**{f: getattr(args, f) for f in asdict(Shape())})
    rows, sampled = measure(s)
    for r in rows:
        print(r, flush=True)
    write_results(results_dir(args.out, args.quick), "draft-ceiling", {"shape": asdict(s), "sampled": sampled},
                  rows, markdown, args.tag)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
