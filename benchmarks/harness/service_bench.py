"""What the side benchmarks share (control_plane.py, prefix_routing.py, rl_semantics.py, staleness.py): a local
Ray instance of their own, the tiny random Llama saved as a HF folder, and the result files
(benchmarks/results/<date>-<hardware>-<benchmark>.json and .md, the machine named in both; a newer run replaces
the older file, result_files.save_newest)."""
from __future__ import annotations

import contextlib
import os
import platform
import shutil
import tempfile
from typing import Callable, Iterator

from benchmarks.harness.report import now_utc
from benchmarks.harness.result_files import save_newest

Body = Callable[[dict, list], list]  # (meta, rows) -> the markdown lines under the heading


@contextlib.contextmanager
def bench_cluster(num_cpus: int) -> Iterator[None]:
    """A local Ray instance for one benchmark run (it ends with the run)."""
    import ray
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, namespace="rollout_service_bench",
             log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def tiny_model_dir(vocab: int = 512) -> Iterator[str]:
    """The bench's tiny-llama (random weights, seed 0) saved with save_pretrained, removed afterwards."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.harness.models import _RANDOM_CONFIGS
    config = _RANDOM_CONFIGS["tiny-llama"]()
    config.vocab_size = vocab
    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="bench-tiny-")
    try:
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def machine() -> dict:
    from benchmarks.harness.harness import hardware_name
    import importlib.metadata

    import torch
    try:  # a side benchmark without a service (speculative_bench, openai_bench) runs where Ray is not installed
        ray = importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        ray = None
    return {"hardware": hardware_name(torch.device("cpu")), "cpu_count": os.cpu_count(), "ray": ray,
            "python": platform.python_version(), "torch": torch.__version__, "started_utc": now_utc(),
            "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None}


def whole_run(row: dict) -> None:
    """The unit of a benchmark whose run is one measurement: a newer run replaces all of an older one."""
    return None


def run_markdown(run: dict, body: Body) -> str:
    """One run of a side benchmark's result file: its heading, the machine, then the benchmark's own tables."""
    meta = run["meta"]
    load = meta.get("loadavg")
    head = [f"# {meta.get('workload', '?')} {meta['started_utc']} on {meta['hardware']}", "",
            f"ray {meta['ray']}, torch {meta['torch']}, python {meta['python']}, {meta['cpu_count']} CPUs; load "
            f"average at the end {load[0] if load else 'n/a'}.", ""]
    return "\n".join(head + body(meta, run["rows"])) + "\n"


def write_results(out_dir: str, bench: str, meta: dict, rows: list[dict], body: Body, tag: str = "",
                  unit: Callable[[dict], object] = whole_run) -> str:
    """Save a side benchmark's run as benchmarks/results/<date>-<hardware>-<bench>.json and .md (replacing the
    older file of this hardware); `body` renders a run's tables from its meta and rows, `tag` labels the run."""
    meta = {**machine(), **meta, **({"tag": tag} if tag else {})}
    path = save_newest(out_dir, bench, {"meta": meta, "ceilings": None, "rows": rows}, unit,
                       lambda run: run_markdown(run, body))
    print(f"wrote {path} and its .md")
    return path
