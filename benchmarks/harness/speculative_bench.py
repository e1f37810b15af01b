"""WS: exact speculative decoding (EngineConfig.speculative="suffix") on vs off, in one run on one device.

Prompts are the GRPO example's arithmetic tasks (rollout_service/examples/tasks.py) through the chat template,
sampled at temperature 1.0 with n samples each, as GRPO samples them, but up to --max-tokens tokens (the
example stops at 16, too short to show decoding speed). For each batch size B (sequences in flight: B / n
prompts of n samples, or one sample of one prompt at B = 1) one engine without speculation and one per drafter
run each wave in turn (the machine's drift falls alike on every mode):
- "cold": the prompts seen for the first time (drafts come from each sequence's own text and its siblings');
- "warm": the same prompts again with new seeds (a later epoch: earlier rollouts of the prompt are history).
tok/s = generated tokens / wall time of the batch; tokens must be identical on and off in every pass.
"tail": one W2-like batch of 8 prompts x n = 8 whose lengths have a long tail (6 prompts stop at 48 tokens,
2 run to 8x that; ignore_eos), timed to its last token, twice a mode (off, on, on, off: each on a new engine).

  python -m benchmarks.harness.speculative_bench --model smollm2-135m --device cpu [--batches 1,8,64]
"""
from __future__ import annotations

import argparse
import gc
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from rollout_service.api.types import RolloutRequest, SamplingParams
from rollout_service.engine.drafter import Drafter, SuffixDrafter

TAIL_ORDER = ("off", "on", "on", "off")  # the long tail's runs (drift cancels out of each mode's sum)


@dataclass
class Shape:
    batches: tuple[int, ...] = (1, 8, 64, 256)
    n: int = 8
    max_tokens: int = 128
    single_prompts: int = 4   # B = 1: this many prompts one after another
    waves: int = 1            # B > 1: this many waves of B / n new prompts one after another
    tail_short: int = 48
    tail_ratio: int = 8


VOCAB = {"size": 0}  # a model without a tokenizer (random weights): prompts are seeded random ids of its vocabulary


def _prompts(count: int, start: int = 0) -> list[Any]:
    if VOCAB["size"]:
        from benchmarks.harness.models import random_prompts
        return random_prompts(count, 40, VOCAB["size"], seed=start)
    from rollout_service.examples import tasks
    train, _ = tasks.split()
    return [train[(start + i) % len(train)].messages() for i in range(count)]


class Replay(Drafter):
    """A drafter that knows the answer: the tokens the run without speculation sampled, each draft token right
    with probability `p` (a draft stops at its first wrong token). Shows what a verify step gives at a given
    acceptance where real text is not at hand (random weights)."""

    def __init__(self, p: float):
        self.p, self.tokens = p, {}

    def learn(self, results: list) -> None:
        self.tokens.update({(r.request_id, r.sample_index): r.token_ids for r in results})

    def propose(self, seq: Any, k: int) -> list[int]:
        import random
        truth = self.tokens.get((seq.request_id, seq.sample_index), [])
        n = seq.num_output_tokens
        rng = random.Random(hash((seq.request_id, seq.sample_index, n)))
        draft = []
        for t in truth[n:n + k]:
            if rng.random() >= self.p:
                draft.append(t + 1 if t else 1)
                break
            draft.append(t)
        return draft

    def forget(self, seq: Any) -> None:
        pass


def _generate(eng: Any, reqs: list[RolloutRequest]) -> tuple[list, float]:
    t0 = time.perf_counter()
    for r in reqs:
        eng.add_request(r)
    out = eng.run_until_done()
    dt = time.perf_counter() - t0
    return sorted(out, key=lambda r: (r.request_id, r.sample_index)), dt


def _batch_requests(batch: int, s: Shape, epoch: int, tag: str) -> list[list[RolloutRequest]]:
    """The waves of requests of one pass: B / n prompts of n samples at once (s.waves of them, each on new
    prompts), or single samples in turn."""
    def sp(i: int, n: int) -> SamplingParams:
        return SamplingParams(n=n, temperature=1.0, max_tokens=s.max_tokens, seed=1000 * epoch + i)
    if batch == 1:
        return [[RolloutRequest(p, sp(i, 1), request_id=f"{tag}-{i}")] for i, p in enumerate(_prompts(s.single_prompts))]
    n, per_wave = min(s.n, batch), max(1, batch // min(s.n, batch))
    prompts = _prompts(per_wave * s.waves)
    return [[RolloutRequest(prompts[i], sp(i, n), request_id=f"{tag}-{i}") for i in range(w, w + per_wave)]
            for w in range(0, len(prompts), per_wave)]


def _spec_counts(eng: Any) -> dict:
    c = eng.counters
    return {"verify_steps": c.spec_verify_steps, "proposed": c.spec_proposed, "accepted": c.spec_accepted,
            "tokens": c.spec_tokens}


def measure(make_engine: Callable[..., Any], s: Shape, drafters: list[str],
            save: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:
    """drafters: "suffix" (the engine's own), "suffix/dry=N" (with N dry steps), or "replay@p" (Replay(p)).
    save(rows so far) after each batch size, so that a run stopped by its time limit keeps what it measured."""
    rows: list[dict] = []
    for batch in s.batches:
        runs = _interleaved_passes(make_engine, batch, s, drafters)
        for drafter in drafters:
            rows += _batch_rows(batch, drafter, runs["off"], runs[drafter])
        save(rows)
    if s.tail_ratio:
        rows.append(tail(make_engine, s))
        print(rows[-1], flush=True)
    return rows


def _interleaved_passes(make_engine: Callable[..., Any], batch: int, s: Shape, drafters: list[str]) -> dict:
    """Per mode ("off" and each drafter), its cold and warm passes as (name, results, seconds, spec counts): one
    engine per mode, all alive at once, each wave run by every engine in turn, so that the machine's drift (on a
    small box, several % over a minute) falls alike on every mode instead of on whichever ran later."""
    modes = {"off": _engine(make_engine, batch, None)}
    try:
        for drafter in drafters:
            modes[drafter] = _engine(make_engine, batch, drafter)
        replays = [e.speculator.drafter for e in modes.values()
                   if e.speculator is not None and isinstance(e.speculator.drafter, Replay)]
        runs: dict[str, list[tuple]] = {m: [] for m in modes}
        for epoch, name in ((0, "cold"), (1, "warm")):
            before = {m: _spec_counts(eng) for m, eng in modes.items()}
            results: dict[str, list] = {m: [] for m in modes}
            seconds = dict.fromkeys(modes, 0.0)
            for wave in _batch_requests(batch, s, epoch, name):
                for m, eng in modes.items():  # "off" first: a replay drafter learns the wave's tokens from it
                    out, dt = _generate(eng, wave)
                    results[m] += out
                    seconds[m] += dt
                    if m == "off":
                        for replay in replays:
                            replay.learn(out)
            for m, eng in modes.items():
                after = _spec_counts(eng)
                runs[m].append((name, results[m], seconds[m], {k: after[k] - before[m][k] for k in after}))
        return runs
    finally:
        del modes
        _free()


def _free() -> None:
    """Give back the memory of engines just dropped (the next ones may need the GPU's)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _engine(make_engine: Callable[..., Any], batch: int, drafter: str | None) -> Any:
    """An engine for one mode of a batch size, warmed up by one small request: speculation off (drafter None) or
    on: "replay@p" with a Replay(p) drafter (it learns each wave from the off engine), "suffix/dry=N" with the
    speculator's dry steps N instead of the engine's choice for its device."""
    eng = make_engine(speculative=None if drafter is None else "suffix", max_num_seqs=max(batch, 8))
    if drafter is not None and drafter.startswith("replay@"):
        eng.speculator.drafter = Replay(float(drafter.split("@")[1]))
    if drafter is not None and "dry=" in drafter:
        eng.speculator.dry_steps = int(drafter.split("dry=")[1].split("/")[0])
    if drafter is not None and "/counts" in drafter:
        eng.speculator.dist_top = 0
    if drafter is not None and "/wide" in drafter:
        eng.speculator.drafter = SuffixDrafter(min_ngram=1, shared=True)
    _generate(eng, [RolloutRequest(_prompts(1, 99)[0], SamplingParams(max_tokens=8), request_id="warm")])
    return eng


def _acceptance(c: dict) -> float:
    return round(c["accepted"] / c["proposed"], 3) if c["proposed"] else 0.0


def _batch_rows(batch: int, drafter: str, off_passes: list, on_passes: list) -> list[dict]:
    rows = []
    for (name, off, t_off, _), (_, on, t_on, c) in zip(off_passes, on_passes):
        tokens = sum(len(r.token_ids) for r in off)
        rows.append({
            "measure": "batch", "batch": batch, "drafter": drafter, "pass": name, "tokens": tokens,
            "off_tok_s": round(tokens / t_off, 1), "on_tok_s": round(tokens / t_on, 1),
            "speedup": round(t_off / t_on, 3), "identical": _identical(off, on),
            "verify_steps": c["verify_steps"], "acceptance": _acceptance(c),
            "tokens_per_verify": round(c["tokens"] / c["verify_steps"], 2) if c["verify_steps"] else 0.0})
        print(rows[-1], flush=True)
    return rows


def _identical(a: list, b: list) -> float:
    """The fraction of sequences whose tokens are the same on and off (1.0: all)."""
    assert [(r.request_id, r.sample_index) for r in a] == [(r.request_id, r.sample_index) for r in b]
    return round(sum(x.token_ids == y.token_ids for x, y in zip(a, b)) / max(1, len(a)), 4)


def tail(make_engine: Callable[..., Any], s: Shape) -> dict:
    """The long-tail batch, cold on a new engine per run, off and on in the order off, on, on, off: the machine's
    drift over the runs (linear: several % a minute on a small box) falls alike on both modes' sums."""
    prompts = _prompts(8, 200)
    lengths = [s.tail_short] * 6 + [s.tail_short * s.tail_ratio] * 2
    seconds, outs, counts = {"off": 0.0, "on": 0.0}, [], []
    for mode in TAIL_ORDER:
        reqs = [RolloutRequest(p, SamplingParams(n=8, temperature=1.0, max_tokens=m, seed=i, ignore_eos=True),
                               request_id=f"tail-{i}") for i, (p, m) in enumerate(zip(prompts, lengths))]
        eng = _engine(make_engine, 64, "suffix" if mode == "on" else None)
        out, dt = _generate(eng, reqs)
        seconds[mode] += dt
        outs.append(out)
        if mode == "on":
            counts.append(_spec_counts(eng))
        del eng
        _free()
    c = {k: sum(x[k] for x in counts) for k in counts[0]}
    runs = TAIL_ORDER.count("on")
    return {"measure": "tail", "batch": 64, "pass": "cold", "tokens": sum(len(r.token_ids) for r in outs[0]),
            "runs": runs, "off_s": round(seconds["off"] / runs, 2), "on_s": round(seconds["on"] / runs, 2),
            "speedup": round(seconds["off"] / seconds["on"], 3),
            "identical": min(_identical(outs[0], o) for o in outs[1:]), "verify_steps": c["verify_steps"],
            "acceptance": _acceptance(c)}


def main(argv: list[str] | None = None) -> int:
    from rollout_service.engine.engine import Engine

    from benchmarks.harness.models import load_bench_model
    from benchmarks.harness.result_files import results_dir
    from benchmarks.harness.service_bench import write_results
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--batches", default="1,8,64,256", help="comma-separated batch sizes")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--drafters", default="suffix", help="comma-separated: suffix (the engine's), replay@P (the "
                   "plain run's tokens, each right with probability P), suffix/dry=N (the engine's, asked again N "
                   "steps after a step without a draft: the CUDA engine's 8, the CPU's 0), suffix/counts (followers "
                   "counted, without the drawn distributions), suffix/wide (one-token suffixes, and every prompt's "
                   "table where the prompt's own has no draft)")
    p.add_argument("--single-prompts", type=int, default=Shape.single_prompts, help="batch 1: prompts in turn")
    p.add_argument("--waves", type=int, default=Shape.waves, help="batch > 1: waves of new prompts in turn")
    p.add_argument("--no-tail", action="store_true", help="skip the long-tail batch")
    p.add_argument("--batch-invariant", action="store_true", help="both engines in batch-invariant mode (then the "
                   "tokens must be identical on any device; otherwise only where the arithmetic is exact: fp32 CPU)")
    p.add_argument("--out", default=None)
    p.add_argument("--tag", default="", help="a label of the run, kept in its meta")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run")
    args = p.parse_args(argv)
    batches = tuple(int(b) for b in args.batches.split(","))
    shape = Shape(batches=(1, 8), max_tokens=16, single_prompts=1, tail_short=8, tail_ratio=2) if args.quick \
        else Shape(batches=batches, max_tokens=args.max_tokens, single_prompts=args.single_prompts,
                   waves=args.waves, tail_ratio=0 if args.no_tail else Shape.tail_ratio)
    bm = load_bench_model(args.model, torch.device(args.device))  # float32 on the CPU, bf16 on a GPU
    hf, tok = bm.hf_model, _tokenizer(args.model)
    VOCAB["size"] = 0 if tok is not None else int(bm.config.vocab_size)

    def make_engine(**o: Any) -> Any:
        seqs = o["max_num_seqs"]
        pages = seqs * (160 + shape.max_tokens * max(1, shape.tail_ratio)) // 16 + 64
        return Engine(model_source=hf, tokenizer=tok, device=args.device,
                      dtype=str(bm.dtype).removeprefix("torch."), num_pages=pages,
                      batch_invariant=args.batch_invariant, **o)

    meta = {"shape": asdict(shape), "model": args.model, "device": args.device, "dtype": str(bm.dtype),
            "batch_invariant": args.batch_invariant,
            "weights": bm.weights, "prompts": "GRPO's arithmetic tasks" if tok else "random token ids"}
    if args.device == "cuda":
        meta["hardware"] = torch.cuda.get_device_name()
    name = "ws-speculative-invariant" if args.batch_invariant else "ws-speculative"
    out = results_dir(args.out, args.quick)
    def save(rows: list[dict]) -> None:
        write_results(out, name, meta, [{**r, "model": args.model} for r in rows], markdown, args.tag, measured_by)

    rows = measure(make_engine, shape, args.drafters.split(","), save)
    save(rows)
    # bf16 on a GPU outside batch-invariant mode: a wider batch may round a near-tie the other way, as in any
    # change of batch, so there the fraction is reported, not required
    exact = args.batch_invariant or args.device == "cpu"
    return 0 if not exact or all(r["identical"] == 1.0 for r in rows) else 1


def measured_by(row: dict) -> tuple:
    """What one row measures, as a result file keeps it: a run replaces the older rows of its model, batch size,
    drafter and pass (or its model's tail) only, so a run of a few batch sizes keeps the others' figures."""
    return row.get("model"), row["measure"], row.get("batch"), row.get("drafter"), row.get("pass")


def _tokenizer(model: str) -> Any:
    """The embedded model's tokenizer (real prompts); None for a random-weights model."""
    from benchmarks.harness.models import EMBEDDED
    if model != EMBEDDED:
        return None
    from transformers import AutoTokenizer

    from rollout_service.model.gguf_cache import pretrained_location
    from rollout_service.model.loader import gguf_file
    path, extra = pretrained_location(gguf_file(EMBEDDED))
    return AutoTokenizer.from_pretrained(path, local_files_only=True, **extra)


def markdown(meta: dict, rows: list[dict]) -> list[str]:
    s = meta["shape"]
    lines = [f"Shape: {s}; one in-process engine per mode on the same model object ({meta.get('dtype')}, weights "
             f"{meta.get('weights')}), each wave run by every mode's engine in turn, temperature 1.0, prompts: "
             f"{meta.get('prompts')}, batch-invariant "
             f"{meta.get('batch_invariant', False)}. identical: the fraction of sequences with the same tokens on and "
             "off.", "",
             "| batch | drafter | pass | tokens | off tok/s | on tok/s | on / off | acceptance | verify steps | "
             "tokens / verify step | identical |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["measure"] == "batch":
            lines.append(f"| {r['batch']} | {r['drafter']} | {r['pass']} | {r['tokens']:,} | {r['off_tok_s']} | "
                         f"{r['on_tok_s']} | "
                         f"{r['speedup']}x | {r['acceptance']} | {r['verify_steps']} | {r['tokens_per_verify']} | "
                         f"{r['identical']} |")
    t = next((r for r in rows if r["measure"] == "tail"), None)
    if t:
        runs = f" (mean of {t['runs']} a mode: off, on, on, off)" if "runs" in t else ""
        lines += ["", f"| long tail (64 sequences){runs} | tokens | off s | on s | off / on | acceptance | identical |",
                  "|---|---|---|---|---|---|---|",
                  f"| to the last token | {t['tokens']:,} | {t['off_s']} | {t['on_s']} | {t['speedup']}x | "
                  f"{t['acceptance']} | {t['identical']} |"]
    return lines


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
