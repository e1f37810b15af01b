"""What every workload needs: the model, ceilings, shapes, options, and a guarded way to measure.

A measurement that fails or runs past the time budget becomes an n/a cell with the reason, never an
aborted run: one broken peer must not cost the numbers of everything else.
"""

from __future__ import annotations

import dataclasses
import gc
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

from benchmarks.harness.ceilings import Ceilings
from benchmarks.harness.models import BenchModel
from benchmarks.harness.report import Cell, Row


@dataclass(frozen=True)
class Shapes:
    """Workload sizes (benchmarks/README.md); --quick and --shape override them."""
    w1_prompt: int = 128
    w1_new: int = 256
    w2_seqs: int = 256
    w2_prompt: int = 128
    w2_new: int = 256
    w2w_seqs: int = 1024  # W2w: W2's prompts and new tokens at an RL batch size
    w2n_prompts: int = 32
    w2n_n: int = 8
    w2n_prompt: int = 512
    w2n_new: int = 512
    w2p_prompts: int = 32
    w2p_n: int = 16
    w2p_prompt: int = 1000
    w2p_new: int = 64
    w3_check_new: int = 16
    w4_batches: tuple = (1, 32, 128)
    w4_contexts: tuple = (1024, 4096)
    w4_prefill_seqs: int = 4
    w4_prefill_len: int = 4096
    w6_prompts: int = 64
    w6_n: int = 8
    w6_prompt: int = 256
    w6_new: int = 512
    w6_steps: int = 2
    w7_episodes: int = 64
    w7_turns: int = 4
    w7_prompt: int = 256
    w7_obs: int = 256
    w7_new: int = 128
    ds_groups: int = 64   # WDS: groups to keep (dynamic sampling's target_groups)
    ds_n: int = 8
    ds_prompt: int = 256
    ds_new: int = 256
    wbi_check: int = 8    # WBI: sequences of each run re-run alone to compare log-prob bytes; 0: all
    wbi_learner_check: int = 0  # WBI: sequences of each run recomputed by the learner forward; 0: all
    wd_steps: int = 10    # WD: optimizer steps, each followed by a delta refresh
    wd_prompts: int = 8   # WD: prompts x n samples per step, new tokens (the GRPO example's: 8 x 8, 16)
    wd_n: int = 8
    wd_new: int = 16
    wd_prompt: int = 64   # WD: token-prompt length (random-weight models; the embedded one runs the example's task)
    wd_light: int = -1    # WD: 1 the memory-light optimizer step, 0 AdamW, -1 AdamW where it fits (delta_bench.py)

    def replace(self, **kw) -> "Shapes":
        return dataclasses.replace(self, **kw)


QUICK = Shapes(w1_prompt=8, w1_new=8, w2_seqs=4, w2_prompt=8, w2_new=8, w2w_seqs=8, w2n_prompts=2, w2n_n=2,
               w2n_prompt=16, w2n_new=8, w2p_prompts=2, w2p_n=4, w2p_prompt=40, w2p_new=12, w3_check_new=4,
               w4_batches=(1, 4), w4_contexts=(64,),
               w4_prefill_seqs=2, w4_prefill_len=64, w6_prompts=2, w6_n=2, w6_prompt=8, w6_new=8,
               w7_episodes=2, w7_turns=2, w7_prompt=8, w7_obs=8, w7_new=4, ds_groups=2, ds_n=2, ds_prompt=8,
               ds_new=8, wd_steps=3, wd_prompts=2, wd_n=4, wd_new=4, wd_prompt=8)
# Issue 2's CPU benchmark: 32 sequences, prompt 128, 64 new tokens.
# W2n on the CPU: the same token count as W2 (4 prompts x 8 samples x 64 tokens), not 131k tokens.
# W2p on the CPU: 4 prompts x n=4, prompt 256, 32 new: HF generate prefills every sample's copy of the
# prompt, 4k tokens (11 s on 2 cores with SmolLM2) where the GPU shape's 512k would take about half an hour;
# prompt tokens still outnumber new ones 8 to 1 per sample, so the row stays prefill-heavy.
# W6 on the CPU: 8 prompts x n=4, prompt 64, 32 new tokens. W7 on the CPU: 8 episodes x 4 turns, prompt and
# observations 128, answers 32. WBI on the CPU checks 8 sequences of each run: a re-run alone is a batch of
# one, which the invariant products pad to a 16-row tile (seconds per sequence with SmolLM2 on 2 cores).
CPU = Shapes(w2_seqs=32, w2_new=64, w2w_seqs=64, w2n_prompts=4, w2n_prompt=128, w2n_new=64, w2p_prompts=4, w2p_n=4,
             w2p_prompt=256, w2p_new=32, w4_batches=(1, 32),
             w4_contexts=(1024,), w4_prefill_len=512, w6_prompts=8, w6_n=4, w6_prompt=64, w6_new=32,
             w7_episodes=8, w7_prompt=128, w7_obs=128, w7_new=32, ds_groups=4, ds_n=4, ds_prompt=32, ds_new=16,
             wbi_check=8, wbi_learner_check=8)


def parse_shape(spec: str) -> tuple[str, object]:
    """'w2_seqs=32' or 'w4_batches=1,32' -> (name, typed value); ValueError names a bad key."""
    key, sep, value = spec.partition("=")
    names = {f.name: f for f in dataclasses.fields(Shapes)}
    if not sep or key not in names:
        raise ValueError(f"--shape {spec!r}: expected KEY=VALUE with KEY one of {', '.join(names)}")
    if isinstance(getattr(Shapes, key), tuple):
        return key, tuple(int(v) for v in value.split(","))
    return key, int(value)


@dataclass
class BenchContext:
    bm: BenchModel
    ceilings: Ceilings
    shapes: Shapes
    backend: str = "auto"
    engine_extra: dict = field(default_factory=dict)
    skip: set = field(default_factory=set)     # "W2n", "hf_static", "llama3-8b:W2n", "llama3-8b:hf_static"
    deadline: float = float("inf")             # time.monotonic() after which remaining parts are skipped
    static_peer: str = "auto"                  # "auto" (GPU only), "on", "off"
    repeats: int = 1                           # runs per generation measurement; the best is kept
    peer_new: int = 0                          # > 0: the HF peers generate at most this many new tokens
    progress: Callable[[str], None] = lambda msg: None
    errors: list = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        return self.bm.device

    def peer_tokens(self, new: int) -> int:
        """New tokens per sequence the HF peers generate where the engine generates `new` (--peer-new-tokens: a
        peer whose every step costs the same, such as transformers' MoE loop, timed on fewer steps)."""
        return min(new, self.peer_new) if self.peer_new > 0 else new

    def skipped(self, name: str, workload: str = "") -> bool:
        """A workload or part (engine, hf_generate, hf_generate_batch, hf_static, ...) named by --skip,
        as NAME, MODEL:NAME, WORKLOAD:PART or MODEL:WORKLOAD:PART."""
        names = {name, f"{workload}:{name}"} if workload else {name}
        return any(n in self.skip or f"{self.bm.name}:{n}" in self.skip for n in names)

    def measure(self, row: Row, part: str, fn: Callable[[], Cell], repeat: bool = False) -> Cell:
        """fn() as a cell, or n/a with the reason. With repeat, fn runs `repeats` times and the best
        value is kept (all are in row.details): on a shared machine the best run is the least disturbed."""
        cells = [self._measure_once(row, part, fn) for _ in range(self.repeats if repeat else 1)]
        values = [c.value for c in cells if c.value is not None]
        if len(cells) > 1:
            row.details[f"{part}_runs"] = [float(f"{v:.4g}") for v in values]
        if not values:
            return cells[0]
        pick = max if row.higher_is_better else min
        return next(c for c in cells if c.value == pick(values))

    def _measure_once(self, row: Row, part: str, fn: Callable[[], Cell]) -> Cell:
        if self.skipped(part, row.workload.split()[0]):
            return Cell.na("skipped by --skip")
        if time.monotonic() > self.deadline:
            return Cell.na("skipped: time budget of this run spent")
        self.progress(f"{self.bm.name} {row.workload} {part}")
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - any failure becomes an n/a cell with its reason
            self.errors.append(f"{self.bm.name} {row.workload} {part}: {traceback.format_exc()}")
            msg = str(exc).splitlines()[0][:200] if str(exc) else ""
            return Cell.na(f"error: {type(exc).__name__}: {msg}")
        finally:
            # Whatever a part left behind (a failed peer's cache, an engine in a reference cycle) must
            # not cost the next part its memory.
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
