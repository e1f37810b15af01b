"""End-to-end generate split into its prefill and decode phases (evidence for the W2 figure).

Times, on one engine: the W2 call itself (cold, as the harness runs it after a 2-prompt warm-up), the same
prompts with max_tokens=1 (the prefill of every prompt plus one sample) twice, and the full call again; the
decode phase is the full call minus the prefill-only call.
    usage: python scripts/lab/profile_generate.py --model llama3-8b [--seqs 256 --prompt-len 128 --new 256]
    W2p: --model qwen2.5-0.5b --seqs 32 --n 16 --prompt-len 1000 --new 64 --temperature 1
The prefix cache is off here: the repeated calls would otherwise find their prompts' KV cached.
"""
from __future__ import annotations

import argparse
import json

import torch

from rollout_service.bench.engine_side import engine_generate, open_engine
from rollout_service.bench.models import load_bench_model, random_prompts


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--backend", default="cuda")
    p.add_argument("--json")
    args = p.parse_args()
    bm = load_bench_model(args.model, torch.device("cuda"))
    prompts = random_prompts(args.seqs, args.prompt_len, bm.vocab_size, seed=2)
    out = {}
    n, temp = args.n, args.temperature
    with open_engine(bm, args.backend, args.seqs * n, args.prompt_len + args.new, {"enable_prefix_cache": False},
                     n=n, prompt_len=args.prompt_len) as client:
        engine_generate(client, bm, [q[:8] for q in prompts[:2]], 2)  # the harness's warm-up
        out["full_cold_s"] = engine_generate(client, bm, prompts, args.new, n, temp, seed=0).seconds
        out["prefill_only_s"] = [engine_generate(client, bm, prompts, 1, n, temp, seed=0).seconds for _ in range(2)]
        out["full_warm_s"] = engine_generate(client, bm, prompts, args.new, n, temp, seed=0).seconds
    total = args.seqs * n * args.new
    pre = min(out["prefill_only_s"])
    out.update(model=args.model, seqs=args.seqs, n=n, prompt_len=args.prompt_len, new=args.new,
               tok_per_s_cold=total / out["full_cold_s"], tok_per_s_warm=total / out["full_warm_s"],
               decode_ms_per_step=1000 * (out["full_warm_s"] - pre) / (args.new - 1),
               prefill_tok_per_s=args.seqs * args.prompt_len / pre)
    print(json.dumps(out, indent=1))
    if args.json:
        json.dump(out, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
