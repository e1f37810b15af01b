"""W3: push a full, changed state dict from a "learner" into the engine, then check generation uses it.

The in-process client path is measured here; the Ray transports (object store, CUDA IPC, NCCL) get
rows that say whether they could be run in this harness.
"""

from __future__ import annotations

import time

import torch

from .ceilings import sync
from .context import BenchContext
from .engine_side import engine_generate, open_engine
from .models import random_prompts
from .peers import hf_generate
from .report import Cell, Row
from .workloads import prefix_agreement

TRANSPORTS = ("object store", "CUDA IPC", "NCCL")


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
    return [row, object_store_row(ctx, new_sd, nbytes, prompts, found.get("hf_after"))] + [
        _unwired(ctx, t, nbytes) for t in TRANSPORTS[1:]]


def _unwired(ctx: BenchContext, transport: str, nbytes: int) -> Row:
    t = Row(ctx.bm.name, f"W3 {transport}", "refresh s through the transport", "s", False)
    why = f"{transport} transport is not benchmarked by this harness yet"
    if ctx.device.type != "cuda":
        why = f"{transport} needs a GPU"
    t.engine = t.hf_generate = t.hf_generate_batch = Cell.na(why)
    t.floor = Cell(2 * nbytes / ctx.ceilings.bandwidth_Bps)
    return t


def object_store_row(ctx: BenchContext, new_sd: dict, nbytes: int, prompts: list[list[int]],
                     hf_after: list[list[int]] | None) -> Row:
    """The learner side packs and ray.put()s once; the worker side ray.get()s, unpacks and updates.
    Both sides run in this process (a local Ray instance), so the hop between processes on one node
    (shared memory) is in, the network between nodes is not."""
    bm = ctx.bm
    row = Row(bm.name, "W3 object store", "refresh s: pack + ray.put + ray.get + update, same node", "s", False)
    row.hf_generate = row.hf_generate_batch = Cell.na("no HF generation peer for a refresh")
    row.floor = Cell(2 * nbytes / ctx.ceilings.bandwidth_Bps)

    def engine() -> Cell:
        try:
            import ray
        except ImportError:
            return Cell.na("Ray is not installed here")
        from rollout_service.weights import fetch, publish

        started = not ray.is_initialized()
        if started:
            # address="local": always a private instance, never a cluster some other process runs here.
            ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
        try:
            with open_engine(bm, ctx.backend, len(prompts), 16 + ctx.shapes.w3_check_new, ctx.engine_extra) as client:
                engine_generate(client, bm, prompts, 1)
                sync(bm.device)
                t0 = time.perf_counter()
                ref = publish(new_sd)
                client.update_weights(fetch(ray.get(ref)), 2)
                engine_generate(client, bm, prompts, 1)
                seconds = time.perf_counter() - t0
                after = engine_generate(client, bm, prompts, ctx.shapes.w3_check_new).token_ids
                del ref
        finally:
            if started:
                ray.shutdown()
        row.details["GBps"] = float(f"{nbytes / seconds / 1e9:.3g}")
        if hf_after is not None:
            row.details["agreement_with_hf_on_new_weights"] = round(prefix_agreement(after, hf_after), 3)
        return Cell(seconds)

    row.engine = ctx.measure(row, "object_store", engine)
    return row

