"""HF transformers peers, run in the same process on the same weights and prompts as the engine.

- `generate`: one padded batch, default dynamic cache.
- `generate_batch`: transformers' own continuous batching with a paged cache (when this version has it).
- `generate` with cache_implementation="static": HF compiles the decode forward with torch.compile.
Greedy runs use min_new_tokens = max_new_tokens so every peer produces exactly as many tokens as the
engine with ignore_eos.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from benchmarks.harness.ceilings import sync
from benchmarks.harness.models import BenchModel


@dataclass
class PeerRun:
    seconds: float                      # submit to last token, synchronised
    token_ids: list[list[int]]          # generated tokens per output sequence
    step_times: list[float] = field(default_factory=list)  # wall clock after each decode step
    call_seconds: float | None = None   # whole call, where `seconds` leaves the peer's set-up out
    basis: str = ""                     # what `seconds` spans, when it is not the whole call
    routed: list | None = None          # the engine's routed experts per sequence (MoE models)


class TokenClock(StoppingCriteria):
    """Never stops; records the time after each generation step, so HF's decode time per step is
    read directly instead of inferred (prefill is the gap before the first stamp)."""

    def __init__(self, device: torch.device):
        self.device, self.stamps = device, []

    def __call__(self, input_ids, scores, **kwargs):
        sync(self.device)
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def generation_config(bm: BenchModel, max_new: int, n: int = 1, temperature: float = 0.0,
                      **extra) -> GenerationConfig:
    sampling = temperature > 0
    kwargs = dict(max_new_tokens=max_new, min_new_tokens=max_new, num_return_sequences=n,
                  do_sample=sampling, pad_token_id=0, **extra)
    if sampling:
        # Plain temperature sampling like the engine's; no HF default top-k/top-p truncation.
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    return GenerationConfig(**kwargs)


def padded_batch(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids + attention mask (decoder-only generation appends on the right)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def hf_generate(bm: BenchModel, prompts: list[list[int]], max_new: int, n: int = 1,
                temperature: float = 0.0, **extra) -> PeerRun:
    ids, mask = padded_batch(prompts, bm.device)
    clock = TokenClock(bm.device)
    cfg = generation_config(bm, max_new, n, temperature, **extra)
    sync(bm.device)
    t0 = time.perf_counter()
    out = bm.hf_model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg,
                               stopping_criteria=StoppingCriteriaList([clock]))
    sync(bm.device)
    seconds = time.perf_counter() - t0
    return PeerRun(seconds, out[:, ids.shape[1]:].tolist(), clock.stamps)


def has_generate_batch(bm: BenchModel) -> bool:
    return callable(getattr(bm.hf_model, "generate_batch", None))


def _cpu_cb_config(bm: BenchModel, prompts: list[list[int]], max_new: int, n: int):
    """On the CPU, size generate_batch's cache to the workload, as the engine's pool is: left to
    itself it sizes a dense attention mask from free host memory and spends ~15 s per call filling it.
    On the GPU its own sizing is what its users get, so it is kept."""
    if bm.device.type == "cuda":
        return None
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        return None
    total = n * sum(len(p) + max_new for p in prompts)
    return ContinuousBatchingConfig(num_blocks=total // 256 + 2 * len(prompts) * n + 2,
                                    max_batch_tokens=min(sum(len(p) for p in prompts), 4096))


def _call_generate_batch(bm: BenchModel, prompts, cfg: GenerationConfig, cb_config):
    # Newer versions take record_timestamps/warmup; older ones (the GPU host's 5.17 may) might not.
    # CUDA-graph warm-up only helps on a GPU; on the CPU it costs seconds per call for nothing.
    opts = dict(record_timestamps=True, warmup=bm.device.type == "cuda")
    if cb_config is not None:
        opts["continuous_batching_config"] = cb_config
    try:
        return bm.hf_model.generate_batch(prompts, generation_config=cfg, progress_bar=False, **opts)
    except TypeError as exc:
        if not any(k in str(exc) for k in opts):
            raise
        return bm.hf_model.generate_batch(prompts, generation_config=cfg, progress_bar=False)


# Not under inference_mode: generate_batch runs its loop in a thread of its own, and 5.17 does not carry
# the caller's inference mode there (its cache set-up then fails on "inference tensors").
def hf_generate_batch(bm: BenchModel, prompts: list[list[int]], max_new: int, n: int = 1,
                      temperature: float = 0.0) -> PeerRun:
    """Timed from the first request's start to the last one's finish when the outputs carry their
    lifespans: the manager's per-call set-up (cache allocation, graph warm-up, thread start) is left
    out, which favours the peer. Without lifespans the whole call is timed."""
    if not has_generate_batch(bm):
        raise RuntimeError("this transformers version has no generate_batch")
    # A fresh config per call: generate_batch rewrites eos_token_id in the config it is given.
    cfg = generation_config(bm, max_new, n, temperature)
    sync(bm.device)
    t0 = time.perf_counter()
    out = _call_generate_batch(bm, prompts, cfg, _cpu_cb_config(bm, prompts, max_new, n))
    sync(bm.device)
    call = time.perf_counter() - t0
    # Request ids are "req_<i>" (plus "__child#k" for extra samples); keep prompt-major order.
    def order(key: str) -> tuple[int, int]:
        base, _, child = key.partition("__child#")
        return int(base.split("_")[-1]), int(child) + 1 if child else 0
    outs = [out[k] for k in sorted(out, key=order)]
    got, want = sum(len(o.generated_tokens) for o in outs), len(prompts) * n * max_new
    if got != want:
        # generate_batch logs a failure in its own thread and returns what it has: surface it here.
        raise RuntimeError(f"generate_batch returned {got} tokens, expected {want} (see its log above)")
    spans = [getattr(o, "lifespan", (-1, -1)) for o in outs]
    seconds, basis = call, "whole call"
    if outs and all(a > 0 and b > 0 for a, b in spans):
        seconds, basis = max(b for _, b in spans) - min(a for a, _ in spans), "request lifespans"
    stamps = list(getattr(outs[0], "timestamps", None) or []) if len(outs) == 1 else []
    return PeerRun(seconds, [list(o.generated_tokens) for o in outs], stamps, call_seconds=call, basis=basis)


def decode_ms_per_step(run: PeerRun) -> float:
    """Mean decode step from the per-step clock: first stamp = prefill + first token."""
    stamps = run.step_times
    if len(stamps) < 2:
        raise ValueError("need at least 2 generated tokens to time a decode step")
    return 1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def hf_static_compiled(bm: BenchModel, prompt: list[int], max_new: int) -> tuple[float, PeerRun]:
    """HF generate with a static cache (auto-compiled decode). Returns (first-call seconds, which is
    mostly compile time, and the timed run after two warm-ups on the same shapes)."""
    run = lambda: hf_generate(bm, [prompt], max_new, cache_implementation="static")  # noqa: E731
    first = run().seconds
    run()  # second warm-up: the compiled graphs are now cached for these shapes
    return first, run()
