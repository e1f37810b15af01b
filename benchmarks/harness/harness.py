"""Command line of the benchmark harness: pick models and workloads, run them, write the report."""

from __future__ import annotations

import gc
import os
import platform
import shlex
import sys
import time

import torch
import transformers
from tqdm import tqdm

from benchmarks.harness.result_files import results_dir
from benchmarks.harness.workload_names import WORKLOADS
from rollout_service.config import DTYPE_NAMES
from benchmarks.harness.attention_bench import w4_kernels
from benchmarks.harness.batch_invariant import wbi_batch_invariant
from benchmarks.harness.ceilings import measure_ceilings
from benchmarks.harness.context import CPU, QUICK, BenchContext, Shapes, parse_shape
from benchmarks.harness.dynamic_sampling_bench import wds_dynamic_sampling
from benchmarks.harness.models import ALIASES, MODEL_NAMES, load_bench_model
from benchmarks.harness.moe_fidelity import wmf_moe_fidelity
from benchmarks.harness.moe_layer import wm_moe_layer
from benchmarks.harness.multiturn import w7_multiturn
from benchmarks.harness.refresh_bench import w3_refresh
from benchmarks.harness.rl_step import w6_fp8, w6_rl_step
from benchmarks.harness.report import Cell, Row, now_utc, write_report
from benchmarks.harness.contention import w1_contended, w2_contended
from benchmarks.harness.decode_profile import wp_decode_profile
from benchmarks.harness.delta_bench import wd_delta_refresh
from benchmarks.harness.workloads import w1_fp8, w1_latency, w2_fp8, w2_rollout, w2n_samples, w2p_long_prompts, w2w_wide, w5_graphs

# the workloads' names and run order: benchmarks/harness/__init__.py
RUNNERS = {"W2": w2_rollout, "W1": w1_latency, "W5": w5_graphs, "W3": w3_refresh, "W4": w4_kernels,
           "W2n": w2n_samples, "W2p": w2p_long_prompts, "W6": w6_rl_step, "W7": w7_multiturn,
           "WDS": wds_dynamic_sampling, "WBI": wbi_batch_invariant, "WM": wm_moe_layer, "WMF": wmf_moe_fidelity,
           "W2w": w2w_wide, "W2fp8": w2_fp8, "W1fp8": w1_fp8, "WP": wp_decode_profile, "W6fp8": w6_fp8,
           "W1c": w1_contended, "W2c": w2_contended, "WD": wd_delta_refresh}
CONFIG_ONLY = ("W6", "W6fp8", "WM")  # workloads that never touch this process's copy of the weights
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def engine_opts(specs: list[str]) -> dict:
    out = {}
    for spec in specs:
        key, sep, value = spec.partition("=")
        if not sep or not key:
            raise ValueError(f"--engine-opt {spec!r}: expected KEY=VALUE")
        out[key] = _value(value)
    return out


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return torch.device(name)


def hardware_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return f"CPU {model} x{os.cpu_count()}"


def resolved_backend(backend: str, device: torch.device) -> str:
    """What "auto" becomes on this device (the engine resolves it the same way)."""
    try:
        from rollout_service.ops import resolve_backend
        return resolve_backend(backend, device)
    except Exception as exc:  # noqa: BLE001 - recorded, not fatal: the engine rows will say more
        return f"unresolved ({type(exc).__name__}: {exc})"


def pick_shapes(args, device: torch.device) -> Shapes:
    shapes = QUICK if args.quick else (CPU if device.type == "cpu" else Shapes())
    return shapes.replace(**dict(parse_shape(s) for s in args.shape))


def run_model(name: str, args, device: torch.device, shapes: Shapes, ceil, rows: list[Row], meta: dict,
              save, bar, deadline: float) -> None:
    dtype = DTYPES[args.dtype] if args.dtype else None
    todo = [w for w in WORKLOADS if w in args.workloads]
    # config-only workloads first: the weights are loaded here only when another workload needs them
    for weights, wls in ((False, [w for w in todo if w in CONFIG_ONLY]), (True, [w for w in todo if w not in CONFIG_ONLY])):
        if not wls:
            continue
        bm = load_bench_model(name, device, dtype, weights=weights)
        meta["models"][name] = {"weights": bm.weights, "dtype": str(bm.dtype).replace("torch.", ""),
                                "params": bm.num_params()}
        ctx = BenchContext(bm, ceil, shapes, args.backend, engine_opts(args.engine_opt), set(args.skip),
                           deadline, args.static_peer, args.repeats, args.peer_new_tokens,
                           progress=lambda m: bar.set_postfix_str(m, refresh=True))
        for wl in wls:
            _run_workload(ctx, name, wl, rows, meta, save)
            bar.update(1)
        del ctx, bm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _run_workload(ctx: BenchContext, name: str, wl: str, rows: list[Row], meta: dict, save) -> None:
    if ctx.skipped(wl):
        rows.append(Row(name, wl, "-", "-", True, engine=Cell.na("skipped by --skip")))
    else:
        try:
            rows.extend(RUNNERS[wl](ctx))
        except Exception as exc:  # noqa: BLE001 - set-up failure of one workload; keep the rest
            ctx.errors.append(f"{name} {wl}: {type(exc).__name__}: {exc}")
            rows.append(Row(name, wl, "-", "-", True, engine=Cell.na(f"error: {type(exc).__name__}: {exc}")))
    meta["errors"] = meta.get("errors", []) + ctx.errors
    ctx.errors = []
    save()


def run(args, argv: list[str] | None) -> int:
    """The benchmark run of arguments parsed by benchmarks.harness.parse_args (argv: for the report)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    shapes = pick_shapes(args, device)
    default = "tiny-llama" if args.quick else ("smollm2-135m" if device.type == "cpu" else "qwen2.5-0.5b")
    models = [ALIASES.get(m.strip(), m.strip()) for m in (args.model or default).split(",") if m.strip()]
    for m in models:
        if m not in MODEL_NAMES:
            raise ValueError(f"--model {m!r}: choose from {', '.join(MODEL_NAMES)}")
    meta = {"started_utc": now_utc(), "hardware": hardware_name(device), "device": str(device),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "repeats": args.repeats, "backend": args.backend,
            "quick": args.quick, "shapes": vars(shapes), "command": shlex.join(["bench", *(argv or sys.argv[1:])]),
            "models": {}}
    if args.tag:
        meta["tag"] = args.tag
    if hasattr(os, "getloadavg"):
        meta["loadavg"] = {"start": os.getloadavg()}
    meta["engine_backend"] = resolved_backend(args.backend, device)
    rows: list[Row] = []
    ceil = measure_ceilings(device, quick=args.quick)

    def save():
        if "loadavg" in meta:
            meta["loadavg"]["end"] = os.getloadavg()
        return write_report(results_dir(args.out, args.quick), meta, ceil.to_dict(), rows)

    end = time.monotonic() + args.budget_s if args.budget_s else float("inf")
    with tqdm(total=len(models) * len(args.workloads), desc="bench", unit="workload") as bar:
        for i, name in enumerate(models):
            # Each model gets an equal share of what is left, so an early finish helps the next one.
            now = time.monotonic()
            run_model(name, args, device, shapes, ceil, rows, meta, save, bar, now + (end - now) / (len(models) - i))
    paths = save()
    print("wrote " + ", ".join(f"{p} (and .md)" for p in paths) if paths else "wrote no result: no workload ran")
    return 0
