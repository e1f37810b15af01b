"""What the Ray-service benchmarks share (prefix_routing.py, control_plane.py): a local Ray instance of their
own, the tiny random Llama saved as a HF folder, and the result files (benchmarks/results/<date>-<hardware>-<tag>
.json and .md, the machine named in both)."""
from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import tempfile
from typing import Iterator

from benchmarks.harness.report import now_utc, result_stem


@contextlib.contextmanager
def bench_cluster(num_cpus: int) -> Iterator[None]:
    """A local Ray instance for one benchmark run (it ends with the run)."""
    import ray
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(num_cpus=num_cpus, include_dashboard=False, namespace="rollout_service_bench", log_to_driver=False)
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
    import torch
    import ray
    return {"hardware": hardware_name(torch.device("cpu")), "cpu_count": os.cpu_count(), "ray": ray.__version__,
            "python": platform.python_version(), "torch": torch.__version__, "started_utc": now_utc(),
            "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None}


def write_results(out_dir: str, tag: str, meta: dict, rows: list[dict], markdown: list[str]) -> tuple[str, str]:
    meta = {**machine(), **meta}
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, result_stem(meta, tag))
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    head = [f"# {tag} {meta['started_utc']} on {meta['hardware']}", "",
            f"ray {meta['ray']}, torch {meta['torch']}, python {meta['python']}, {meta['cpu_count']} CPUs; load "
            f"average at the end {meta['loadavg'][0] if meta['loadavg'] else 'n/a'}.", ""]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(head + markdown) + "\n")
    print(f"wrote {stem}.json and {stem}.md")
    return stem + ".json", stem + ".md"
