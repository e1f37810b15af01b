"""The engine under test, driven only through its public client API (RolloutClient.local)."""

from __future__ import annotations

import gc
import math
import time
from contextlib import contextmanager

import torch

from benchmarks.harness.ceilings import sync
from benchmarks.harness.models import BenchModel
from benchmarks.harness.peers import PeerRun

PAGE_SIZE = 16


def kv_pages(num_seqs: int, max_len: int, page_size: int = PAGE_SIZE, n: int = 1, prompt_len: int = 0) -> int:
    """Pages for every sequence at full length, plus headroom. The n samples of a prompt share its full
    prompt pages (the engine forks them; only the partial last page is copied), so those count once per
    prompt: for 32 prompts x n=16 of 1000 + 64 tokens that is 4,552 pages, not 34,312."""
    if n < 1 or num_seqs % n:
        raise ValueError(f"kv_pages: n={n} must be >= 1 and divide num_seqs={num_seqs}")
    if not 0 <= prompt_len <= max_len:
        raise ValueError(f"kv_pages: prompt_len={prompt_len} must be in 0..max_len={max_len}")
    shared = prompt_len // page_size if n > 1 else 0
    return num_seqs // n * shared + num_seqs * (math.ceil(max_len / page_size) - shared) + 8


def engine_options(bm: BenchModel, num_seqs: int, max_len: int, extra: dict, n: int = 1,
                   prompt_len: int = 0) -> dict:
    """Size the KV pool for exactly this workload (kv_pages), so the engine never holds memory the HF
    peers that run after it will need. Decode graphs cover the whole batch: past the default 256 a step
    would otherwise run eagerly (at or below 256 this is the engine's own choice, min(256, max_num_seqs))."""
    page_size = extra.get("page_size", PAGE_SIZE)
    opts = dict(device=str(bm.device), num_pages=kv_pages(num_seqs, max_len, page_size, n, prompt_len),
                max_num_seqs=max(num_seqs, 1), max_model_len=max_len, cuda_graph_max_batch=max(num_seqs, 1))
    opts.update(extra)
    return opts


@contextmanager
def open_engine(bm: BenchModel, backend: str, num_seqs: int, max_len: int, extra: dict, n: int = 1,
                prompt_len: int = 0):
    """n, prompt_len: the samples per prompt and the prompt length, when prompts are shared (kv_pages)."""
    from rollout_service import RolloutClient  # imported late: the harness runs without an engine too

    client = RolloutClient.local(model=bm.hf_model, backend=backend,
                                 **{"dtype": None, **engine_options(bm, num_seqs, max_len, extra, n, prompt_len)})
    try:
        yield client
    finally:
        client.close()
        del client
        gc.collect()  # the engine may sit in reference cycles; its KV pool and weights go now
        if bm.device.type == "cuda":
            torch.cuda.empty_cache()


def sampling(max_new: int, n: int = 1, temperature: float = 0.0, seed: int | None = None,
             logprobs_mode: str = "processed", routed: bool = False):
    """routed: each result carries its routed experts (an MoE model's run, for the floor's expert count)."""
    from rollout_service import SamplingParams

    return SamplingParams(n=n, temperature=temperature, max_tokens=max_new, ignore_eos=True, seed=seed,
                          logprobs_mode=logprobs_mode, return_routed_experts=routed)


def timed_generate(client, device: torch.device, prompts: list[list[int]], sp) -> tuple[float, list]:
    """(seconds, results) end to end: submit every prompt, wait for the last result; every token asked for
    must come back (sp ignores EOS)."""
    sync(device)
    t0 = time.perf_counter()
    results = client.generate(prompts, sampling=sp)
    sync(device)
    seconds = time.perf_counter() - t0
    n_out, want = sum(len(r.token_ids) for r in results), len(prompts) * sp.n * sp.max_tokens
    if n_out != want:
        raise RuntimeError(f"engine returned {n_out} tokens, expected {want}")
    return seconds, results


def engine_generate(client, bm: BenchModel, prompts: list[list[int]], max_new: int, n: int = 1,
                    temperature: float = 0.0, seed: int | None = None) -> PeerRun:
    """End to end: submit every prompt, wait for the last result. An MoE model's results carry their routed
    experts (the cost of returning them is in the time, as for a user of routing replay)."""
    routed = bm.moe is not None
    seconds, results = timed_generate(client, bm.device, prompts, sampling(max_new, n, temperature, seed,
                                                                           routed=routed))
    return PeerRun(seconds, [list(r.token_ids) for r in results],
                   routed=[r.routed_experts for r in results] if routed else None)


def engine_ms_per_step(client, bm: BenchModel, prompt: list[int], max_new: int) -> tuple[float, PeerRun]:
    """Decode ms/step, timed step by step on the client's in-process engine like HF's step clock: the
    first step is prefill + first token (the prompt fits one step's token budget), every later one a
    decode step (a final step that only hands back the result costs ~nothing). No device sync between
    steps: a step returns once the tokens it records are on the host, and with overlapped decode the next
    step is already running on the GPU then (a sync there would measure the steps one at a time). Without
    an in-process engine: (T(max_new) - T(1)) / (max_new - 1) from two end-to-end runs."""
    engine = getattr(client, "engine", None)
    if engine is None or not hasattr(engine, "step"):
        first = min(engine_generate(client, bm, [prompt], 1).seconds for _ in range(2))
        full = engine_generate(client, bm, [prompt], max_new)
        return 1000 * (full.seconds - first) / (max_new - 1), full
    from rollout_service import RolloutRequest

    # The client's own stepping thread is paused meanwhile: it would otherwise step the same engine too
    # (taking turns with this loop, and maybe the result).
    client.pause()
    try:
        engine.add_request(RolloutRequest(prompt=list(prompt), sampling=sampling(max_new)))
        sync(bm.device)
        t0 = time.perf_counter()
        stamps, results = [], []
        while engine.has_unfinished() and len(stamps) < 4 * max_new + 64:
            results += engine.step()
            stamps.append(time.perf_counter())
        sync(bm.device)
    finally:
        client.resume()
    if len(results) != 1 or len(results[0].token_ids) != max_new:
        raise RuntimeError(f"engine step loop gave {[len(r.token_ids) for r in results]} tokens, "
                           f"expected [{max_new}]")
    ms = 1000 * (stamps[-1] - stamps[0]) / (max_new - 1)
    return ms, PeerRun(stamps[-1] - t0, [list(results[0].token_ids)], stamps)


def engine_facts(client) -> dict:
    """What the engine says about the run just timed (backend in use, preemptions), for the notes."""
    try:
        stats = client.stats()
    except Exception:  # noqa: BLE001 - facts are optional; the timing stands without them
        return {}
    st = stats[0] if isinstance(stats, list) and stats else stats
    keys = ("backend", "preemptions", "recomputes")
    return {f"engine_{k}": st[k] for k in keys if isinstance(st, dict) and k in st}
