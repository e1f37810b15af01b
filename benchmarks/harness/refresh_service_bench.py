"""W3 through the service: a learner (this process) refreshes one Ray rollout worker by each transport,
then puts it to sleep and wakes it (benchmarks/README.md, W3).

The worker starts with random weights (load_format="dummy") on the model's config. For every transport
the learner pushes full state dicts B, A, B (A = the refreshed weights of "W3 local", B = A with one norm
scaled, so each push changes the tokens): the first push is cold (buffers allocated, pinned, mapped), the
third is the steady one a training loop sees, and the engine cell. Every push is dense (delta=False): B and A
differ in one norm, which the default delta="auto" would send alone (WD, delta_bench.py, measures deltas after
real optimizer steps). After each push the worker's greedy tokens are checked against the in-process engine's on
the same weights. Without Ray (or a GPU, for CUDA IPC) a row says why it could not run.
"""
from __future__ import annotations

import tempfile
import time
from contextlib import contextmanager

import torch

from benchmarks.harness.context import BenchContext
from benchmarks.harness.engine_side import PAGE_SIZE, sampling
from benchmarks.harness.report import Cell, Row

TRANSPORT_ROWS = (("object_store", "object_store"), ("cuda_ipc", "cuda_ipc"),
                  ("broadcast (gloo)", "broadcast"), ("broadcast (nccl)", "broadcast"))


@contextmanager
def one_worker_service(ctx: BenchContext, num_prompts: int, max_len: int, name: str = "w3-bench",
                       **engine_overrides):
    """A private local Ray instance (the caller's when one runs) with one rollout worker on this device, started
    from the config only (random weights); `engine_overrides` replace any engine option (WD's: dtype="bfloat16",
    and for the embedded model model="smollm2-135m", load_format="auto")."""
    import ray

    from rollout_service import RolloutClient

    bm = ctx.bm
    folder = tempfile.mkdtemp(prefix="w3-config-")
    bm.config.save_pretrained(folder)  # config.json only: the worker draws random weights
    gpus = torch.cuda.device_count() if bm.device.type == "cuda" else 0
    started = not ray.is_initialized()
    if started:
        # the workers inherit this process's environment (PYTHONPATH included)
        ray.init(address="local", num_cpus=4, num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    engine = dict(model=folder, load_format="dummy", backend=ctx.backend, dtype=str(bm.dtype).removeprefix("torch."),
                  device=bm.device.type, num_pages=num_prompts * -(-max_len // PAGE_SIZE) + 8,
                  max_model_len=max_len, **ctx.engine_extra)
    engine.update(engine_overrides)
    # a worker's start takes seconds on a quiet machine and minutes on a busy one (beside two busy processes it
    # ran past the default 120 s): a benchmark must not fail for that
    client = RolloutClient.launch({"name": name, "num_workers": 1, "engine": engine,
                                   "resources": {"num_cpus": 1, "num_gpus": 1 if gpus else 0},
                                   "placement": {"timeout_s": 600}})
    try:
        yield client
    finally:
        client.close()
        if started:
            ray.shutdown()


def _tokens(client, prompts: list[list[int]], new: int) -> list[list[int]]:
    return [list(r.token_ids) for r in client.generate(prompts, sampling(new))]


def w3_service_rows(ctx: BenchContext, new_sd: dict, nbytes: int, prompts: list[list[int]],
                    reference: dict) -> list[Row]:
    """reference: the in-process engine's greedy tokens on A ("after") and B ("after_b")."""
    bm = ctx.bm
    rows = [Row(bm.name, f"W3 {label}", "refresh s through the service (steady push), 1 worker", "s", False)
            for label, _ in TRANSPORT_ROWS]
    cycle = Row(bm.name, "W3 sleep/wake", "sleep(1) -> wake_up() s through the service", "s", False)
    for r in rows + [cycle]:
        r.hf_generate = r.hf_generate_batch = Cell.na("no HF generation peer for a refresh")
        r.floor = Cell(2 * nbytes / ctx.ceilings.bandwidth_Bps)
    why = "skipped by --skip" if ctx.skipped("service", "W3") else None
    try:
        import ray  # noqa: F401
    except ImportError:
        why = "Ray is not installed here"
    if why:
        for r in rows + [cycle]:
            r.engine = Cell.na(why)
        return rows + [cycle]
    b_sd = b_weights(new_sd)
    new = ctx.shapes.w3_check_new
    with one_worker_service(ctx, len(prompts), max(len(p) for p in prompts) + new) as client:
        version = iter(range(1, 1000))
        for row, (label, transport) in zip(rows, TRANSPORT_ROWS):
            row.engine = ctx.measure(row, transport, lambda: _push_pair(
                ctx, client, row, label, transport, new_sd, b_sd, nbytes, prompts, reference, version))
        cycle.engine = ctx.measure(cycle, "sleep_wake", lambda: _sleep_wake(
            ctx, client, cycle, new_sd, prompts, reference, version))
    return rows + [cycle]


def _push_pair(ctx, client, row: Row, label: str, transport: str, a_sd: dict, b_sd: dict, nbytes: int,
               prompts, reference: dict, version) -> Cell:
    if transport == "cuda_ipc" and ctx.device.type != "cuda":
        return Cell.na("CUDA IPC needs a GPU")
    if label.endswith("(nccl)"):
        if torch.cuda.device_count() < 2:
            return Cell.na("NCCL needs the learner and the worker on two GPUs (it refuses two ranks on one)")
        client.init_weight_group(backend="nccl")
    elif label.endswith("(gloo)"):
        t0 = time.perf_counter()
        client.init_weight_group(backend="gloo")
        row.details["group_init_s"] = round(time.perf_counter() - t0, 3)
    new = ctx.shapes.w3_check_new
    times, equal = [], []
    # B (cold: buffers allocated, pinned, mapped), A, B: the third push is the steady state of a training
    # loop (the object store's pages too are reused only from the third push on: the router keeps the
    # last refresh's objects for restarted workers while the next one is being put)
    for sd, want in ((b_sd, "after_b"), (a_sd, "after"), (b_sd, "after_b")):
        t0 = time.perf_counter()
        used = client.update_weights(sd, next(version), transport=transport, delta=False)
        times.append(time.perf_counter() - t0)
        equal.append(_tokens(client, prompts, new) == reference[want])
    row.details.update(transport=used, pushes_s=[round(t, 4) for t in times], tokens_equal_in_process=equal,
                       GBps=round(nbytes / times[-1] / 1e9, 2))
    learner = getattr(getattr(client, "_connection", None), "weights", None)
    if learner is not None:  # where the steady push spent its time, learner side and worker side
        row.details["learner_s"] = {k: round(v, 4) for k, v in learner.last_timings.items() if k != "transport"}
    row.details["worker_s"] = {k: v for k, v in client.stats()[0].get("last_refresh", {}).items() if k != "transport"}
    if transport == "broadcast" or transport == "cuda_ipc":
        client.release_weight_buffers()
    return Cell(times[-1])


def _sleep_wake(ctx, client, row: Row, a_sd: dict, prompts, reference: dict, version) -> Cell:
    new = ctx.shapes.w3_check_new
    stats = lambda: client.stats()[0]  # noqa: E731
    awake = stats()
    before = _tokens(client, prompts, new)  # (on whichever weights the transport rows pushed last)
    cycles = []
    for _ in range(2):  # the first sleep pins its host buffers; the second is what every later step pays
        t0 = time.perf_counter()
        client.sleep(1)
        t1 = time.perf_counter()
        client.wake_up()
        cycles.append((t1 - t0, time.perf_counter() - t1))
    asleep1 = _asleep_memory(client, 1)
    row.details["tokens_equal_after_wake"] = _tokens(client, prompts, new) == before
    # the colocated RL step: drop the weights, the learner pushes new ones, wake
    client.sleep(2)
    asleep2 = stats()
    t0 = time.perf_counter()
    transport = "cuda_ipc" if ctx.device.type == "cuda" else "object_store"
    client.update_weights(a_sd, next(version), transport=transport, delta=False)
    t1 = time.perf_counter()
    client.wake_up()
    t2 = time.perf_counter()
    row.details["tokens_equal_after_level2_refresh"] = _tokens(client, prompts, new) == reference["after"]
    gib = lambda b: None if b is None else round(b / 2**30, 3)  # noqa: E731
    row.details.update(
        sleep1_s=[round(a, 3) for a, _ in cycles], wake1_s=[round(b, 3) for _, b in cycles],
        first_cycle_s=round(sum(cycles[0]), 3), graph_capture_s=round(stats()["graph_capture_s"], 3),
        awake_GiB=gib(awake["device_memory_bytes"]), asleep1_GiB=gib(asleep1["device_memory_bytes"]),
        asleep2_GiB=gib(asleep2["device_memory_bytes"]),
        awake_process_GiB=gib(awake.get("process_gpu_bytes")),
        asleep2_process_GiB=gib(asleep2.get("process_gpu_bytes")),
        level2_refresh_s=round(t1 - t0, 3), level2_wake_s=round(t2 - t1, 3), level2_transport=transport)
    client.release_weight_buffers()
    return Cell(sum(cycles[1]))


def _asleep_memory(client, level: int) -> dict:
    client.sleep(level)
    try:
        return client.stats()[0]
    finally:
        client.wake_up()


def b_weights(a: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A second full state dict that differs from `a` in its tokens: the final norm scaled."""
    b = dict(a)
    norm = next(k for k in a if k.endswith("model.norm.weight"))
    b[norm] = a[norm] * 1.5
    return b
