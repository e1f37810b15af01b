"""A local rollout on the embedded SmolLM2-135M-Instruct: prompts, completions, per-token logprobs, tokens/s.

    python scripts/demo.py [--n 2] [--max-tokens 48] [--temperature 0.7]
"""
from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from rollout_service import RolloutClient, SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Give me one tip for writing clean Python code.",
    "What is 12 times 7?",
    "Name a planet with rings.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=2, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    console = Console()
    with console.status(f"loading {args.model}"):
        client = RolloutClient.local(args.model)
    sampling = SamplingParams(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
                              logprobs=2)
    start = time.perf_counter()
    results = client.generate(PROMPTS, sampling)
    elapsed = time.perf_counter() - start
    tok = client.engine.tokenizer
    for i, r in enumerate(results):
        console.rule(f"[bold]{PROMPTS[i // args.n]}[/] (sample {r.sample_index})")
        console.print(r.text, f"[dim]({r.finish_reason}, {len(r.token_ids)} tokens)[/]")
        table = Table("token", "logprob", "top alternatives", box=None, pad_edge=False)
        for t, lp, top in list(zip(r.token_ids, r.logprobs, r.top_logprobs))[:8]:
            alts = ", ".join(f"{tok.decode([i])!r} {v:.2f}" for i, v in top.items())
            table.add_row(repr(tok.decode([t])), f"{lp:.4f}", alts)
        console.print(table)
    n_tokens = sum(len(r.token_ids) for r in results)
    console.rule()
    console.print(f"{len(results)} samples, {n_tokens} tokens in {elapsed:.2f} s: "
                  f"[bold]{n_tokens / elapsed:.1f} tokens/s[/] on {client.stats()[0]['device']} "
                  f"(backend {client.stats()[0]['backend']})")
    client.close()


if __name__ == "__main__":
    main()
