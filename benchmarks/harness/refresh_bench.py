"""W3: push a full, changed state dict from a "learner" into the engine, then check generation uses it.

The in-process client path is measured here; every transport through the Ray service, and the sleep/wake
cycle, in refresh_service.py.
"""

from __future__ import annotations

import time

import torch

from benchmarks.harness.ceilings import sync
from benchmarks.harness.context import BenchContext
from benchmarks.harness.engine_side import engine_generate, open_engine
from benchmarks.harness.models import random_prompts
from benchmarks.harness.peers import hf_generate
from benchmarks.harness.refresh_service_bench import b_weights, w3_service_rows
from benchmarks.harness.report import Cell, Row
from benchmarks.harness.workloads import prefix_agreement



def timed(fn, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def perturbed_weights(model: torch.nn.Module, seed: int = 123) -> dict[str, torch.Tensor]:
    """What a learner would send after a step: every parameter (a tied embedding once), changed.
    named_parameters() lists a shared tensor under one name, which keeps ties intact."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
        out[name] = (p.detach().float() + 0.02 * noise).to(p.dtype)
    return out


def w3_refresh(ctx: BenchContext) -> list[Row]:
    bm, s = ctx.bm, ctx.shapes
    prompts = random_prompts(2, 16, bm.vocab_size, seed=4)
    new_sd = perturbed_weights(bm.hf_model)
    nbytes = sum(t.numel() * t.element_size() for t in new_sd.values())
    row = Row(bm.name, "W3 local", f"refresh s, full state dict {nbytes / 1e9:.2f} GB, in-process client",
              "s", False)
    row.hf_generate = row.hf_generate_batch = Cell.na("no HF generation peer for a refresh")
    found = {}

    def engine() -> Cell:
        with open_engine(bm, ctx.backend, len(prompts), 16 + s.w3_check_new, ctx.engine_extra) as client:
            base = min(engine_generate(client, bm, prompts, 1).seconds for _ in range(2))
            found["before"] = engine_generate(client, bm, prompts, s.w3_check_new).token_ids
            call = timed(lambda: client.update_weights(new_sd, 1), bm.device)
            # The update may land at the next step boundary: count that step, less a plain one.
            first = engine_generate(client, bm, prompts, 1).seconds
            found["after"] = engine_generate(client, bm, prompts, s.w3_check_new).token_ids
            # the service rows check their tokens against this engine's on the same weights
            client.update_weights(b_weights(new_sd), 2)
            found["after_b"] = engine_generate(client, bm, prompts, s.w3_check_new).token_ids
        seconds = call + max(first - base, 0.0)
        row.details.update(update_call_s=float(f"{call:.3g}"), GBps=float(f"{nbytes / seconds / 1e9:.3g}"))
        return Cell(seconds)

    def hf_load() -> Cell:
        seconds = timed(lambda: bm.hf_model.load_state_dict(new_sd, strict=False), bm.device)
        found["hf_after"] = hf_generate(bm, prompts, s.w3_check_new).token_ids
        return Cell(seconds, "HF load_state_dict")

    row.engine = ctx.measure(row, "engine", engine)
    row.other_peer = ctx.measure(row, "hf_load_state_dict", hf_load)
    # Copy bandwidth counts read + write: moving the state dict once reads and writes nbytes each.
    row.floor = Cell(2 * nbytes / ctx.ceilings.bandwidth_Bps)
    if "after" in found:
        row.details["tokens_changed_by_refresh"] = found["after"] != found["before"]
    if "after" in found and "hf_after" in found:
        agree = prefix_agreement(found["after"], found["hf_after"])
        row.details["agreement_with_hf_on_new_weights"] = round(agree, 3)
    if "after_b" not in found:
        return [row]
    return [row] + w3_service_rows(ctx, new_sd, nbytes, prompts, found)
