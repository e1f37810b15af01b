"""A local rollout on the embedded SmolLM2-135M-Instruct: prompts, completions, per-token logprobs, tokens/s.

    python scripts/demo.py [--n 2] [--max-tokens 48] [--temperature 0.7]
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from rollout_service import RolloutClient, SamplingParams


PROMPTS = [
    "What is the capital of France?",
    "Give me one tip for writing clean Python code.",
    "What is 12 times 7?",
    "Name a planet with rings.",
]


SHOWN_TOKENS = 8  # rows of each sample's token table: enough to see the log-probs, short enough to read


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m",
                    help="'smollm2-135m', a HF folder or a .gguf file (default: %(default)s)")
    ap.add_argument("--n", type=int, default=2, help="samples per prompt (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=48, help="new tokens per sample (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.7, help="(default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # --help answers before torch is imported (seconds on a busy machine)
    from rollout_service import RolloutClient, SamplingParams
    from rollout_service.model.loader import check_source

    console = Console()
    try:
        # both checked before the model loads: a typo costs a second, not a load
        sampling = SamplingParams(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens,
                                  seed=args.seed, logprobs=2)
        check_source(args.model)
        with console.status(f"loading {args.model}"):
            client = RolloutClient.local(args.model)
    except ValueError as e:
        # soft_wrap: a path in the message stays copyable; escape: brackets are text, not rich markup
        console.print(f"[red]error:[/red] {escape(str(e))}", soft_wrap=True)
        return 2
    with client:
        show(console, client, sampling)
    return 0


def show(console: Console, client: RolloutClient, sampling: SamplingParams) -> None:
    start = time.perf_counter()
    results = client.generate(PROMPTS, sampling)
    elapsed = time.perf_counter() - start
    tok = client.engine.tokenizer
    for i, r in enumerate(results):
        console.rule(f"[bold]{PROMPTS[i // sampling.n]}[/] (sample {r.sample_index})")
        console.print(r.text, f"[dim]({r.finish_reason}, {len(r.token_ids)} tokens)[/]")
        shown = min(SHOWN_TOKENS, len(r.token_ids))
        table = Table("token", "logprob", "top alternatives", box=None, pad_edge=False,
                      caption=f"the first {shown} of {len(r.token_ids)} tokens", caption_justify="left")
        for t, lp, top in list(zip(r.token_ids, r.logprobs, r.top_logprobs))[:shown]:
            alts = ", ".join(f"{tok.decode([i])!r} {v:.2f}" for i, v in top.items())
            table.add_row(repr(tok.decode([t])), f"{lp:.4f}", alts)
        console.print(table)
    n_tokens = sum(len(r.token_ids) for r in results)
    stats = client.stats()[0]
    console.rule()
    console.print(f"{len(results)} samples, {n_tokens} tokens in {elapsed:.2f} s: "
                  f"[bold]{n_tokens / elapsed:.1f} tokens/s[/] on {stats['device']} (backend {stats['backend']})")


if __name__ == "__main__":
    sys.exit(main())
