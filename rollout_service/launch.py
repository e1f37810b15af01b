"""Rollout-only job: start the service described by a config, roll out its prompts, write the results
as msgpack and print a summary. The `ray job submit` entrypoint (docs/service.md: "Ray job submission"):

    RAY_AUTH_MODE=token ray job submit --working-dir . -- python -m rollout_service.launch \
        --config cluster_configs/local-cpu.yaml --output "$PWD/rollout_results.msgpack"

A job runs in Ray's temporary copy of --working-dir, so a relative --output lands there: pass an absolute one.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

from rollout_service.config import ServiceConfig, local_ray_wanted
from rollout_service.results.file import save_results
from rollout_service.api.types import RolloutRequest, RolloutResult

DEFAULT_OUTPUT = "rollout_results.msgpack"


def load_prompts(path: str | None, limit: int | None = None) -> list[dict]:
    """Prompt records from a JSONL file (one JSON string, or an object with "prompt" and optional
    "metadata" / "sampling" / "request_id" per line), or the built-in sample set when path is None."""
    if path is None:
        from rollout_service.examples.sample_prompts import SAMPLE_PROMPTS
        records = [dict(r) for r in SAMPLE_PROMPTS]
    else:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"prompts file {path!r}: cannot read ({e.strerror})") from None
        records = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            rec = {"prompt": rec} if not isinstance(rec, dict) else rec
            _check_record(rec, f"{path}:{n}")
            records.append(rec)
        if not records:
            raise ValueError(f"prompts file {path!r} holds no prompts")
    return records[:limit] if limit else records


PROMPT_KEYS = ("prompt", "metadata", "sampling", "request_id")


def _check_record(rec: dict, where: str) -> None:
    """Unknown keys are refused, not skipped: a misspelt 'sampling' would otherwise roll out on the defaults."""
    from dataclasses import fields

    from rollout_service.config import did_you_mean
    from rollout_service.api.types import SamplingParams

    if "prompt" not in rec:
        raise ValueError(f"{where}: a prompt record needs a 'prompt' key")
    unknown = sorted(set(rec) - set(PROMPT_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}{did_you_mean(unknown, set(PROMPT_KEYS))}; "
                         f"a record holds {list(PROMPT_KEYS)}")
    sampling = rec.get("sampling")
    if sampling is None:
        return
    if not isinstance(sampling, dict):
        raise ValueError(f"{where}: 'sampling' must be an object of SamplingParams fields, got "
                         f"{type(sampling).__name__}")
    known = {f.name for f in fields(SamplingParams)}
    unknown = sorted(set(sampling) - known)
    if unknown:
        raise ValueError(f"{where}: unknown sampling key(s) {unknown}{did_you_mean(unknown, known)}")


def build_requests(config: ServiceConfig, records: list[dict]) -> list[RolloutRequest]:
    reqs = []
    for i, rec in enumerate(records):
        try:
            sampling = config.sampling_params(**(rec.get("sampling") or {}))
            reqs.append(RolloutRequest(prompt=rec["prompt"], sampling=sampling, metadata=rec.get("metadata"),
                                       request_id=str(rec.get("request_id") or f"prompt-{i}"),
                                       apply_chat_template=config.apply_chat_template))
        except (ValueError, TypeError) as e:
            raise ValueError(f"prompt {i}: {e}") from None
    return reqs


def prepare(config: ServiceConfig) -> tuple[list[RolloutRequest], Path]:
    """(the requests, the results file): everything a rollout can judge before Ray or any worker starts, each
    a one-line ValueError within seconds: the prompts, the results path, and the model where this process can
    see it (a bare name; a path when the workers run on this machine)."""
    from rollout_service.model.loader import check_source_here

    reqs = build_requests(config, load_prompts(config.prompts, config.num_prompts))
    output = output_path(config)
    check_source_here(config.engine.model, local=local_ray_wanted(config.address))
    return reqs, output


def run(config: ServiceConfig, on_result: Callable[[RolloutResult], None] | None = None,
        on_start: Callable[[int], None] | None = None,
        prepared: tuple[list[RolloutRequest], Path] | None = None) -> dict:
    """Launch the service, roll out every prompt, write results, shut down; returns the summary. prepared:
    prepare(config)'s result when the caller checked the inputs already."""
    reqs, output = prepared or prepare(config)
    import ray

    from rollout_service.connections.ray import RayConnection

    started_ray = not ray.is_initialized()
    t0 = time.perf_counter()
    backend = RayConnection.start_service(config)
    t_ready = time.perf_counter()
    results: list[RolloutResult] = []
    try:
        if on_start is not None:
            on_start(sum(r.sampling.n for r in reqs))
        for r in backend.submit(reqs):
            results.append(r)
            if on_result is not None:
                on_result(r)
        t_done = time.perf_counter()
        workers, info = backend.stats(), backend.info()
    finally:
        backend.close()
        if started_ray:
            ray.shutdown()
    order = {r.request_id: i for i, r in enumerate(reqs)}
    results.sort(key=lambda r: (order[r.request_id], r.sample_index))
    save_results(output, results)
    return summarize(results, workers, info, startup_s=t_ready - t0, rollout_s=t_done - t_ready, output=output)


def output_path(config: ServiceConfig) -> Path:
    """The results file, absolute (a relative one is taken from the current directory), its folder made now:
    a path that cannot be written fails before the rollout, not after it."""
    path = Path(os.path.abspath(Path(config.output or DEFAULT_OUTPUT).expanduser()))
    if path.is_dir():
        raise ValueError(f"output {str(path)!r} is a folder: give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"output {str(path)!r}: cannot make its folder ({e.strerror})") from None
    if not os.access(path.parent, os.W_OK):
        raise ValueError(f"output {str(path)!r}: its folder is not writable")
    return path


def summarize(results: list[RolloutResult], workers: list[dict], info: dict, startup_s: float,
              rollout_s: float, output: Path) -> dict:
    out_tokens = sum(len(r.token_ids) for r in results)
    return {
        "prompts": len({r.request_id for r in results}), "samples": len(results), "output_tokens": out_tokens,
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in results),
        "finish_reasons": dict(collections.Counter(r.finish_reason for r in results)),
        "startup_s": round(startup_s, 3), "rollout_s": round(rollout_s, 3),
        "tokens_per_s": round(out_tokens / rollout_s, 2) if rollout_s > 0 else 0.0,
        "workers": len(workers), "policy_version": info.get("policy_version"),
        "resubmitted": info.get("resubmitted", 0), "output": str(output),
        "per_worker": [{k: w.get(k) for k in ("worker", "alive", "tokens_per_s", "kv_pages_total", "node_id")}
                       for w in workers],
        "example": _example(results),
    }


def _example(results: list[RolloutResult]) -> str:
    return results[0].text[:200] if results and results[0].text else ""


def format_summary(s: dict) -> str:
    lines = ["rollout summary"]
    for k in ("prompts", "samples", "prompt_tokens", "output_tokens", "finish_reasons", "startup_s", "rollout_s",
              "tokens_per_s", "workers", "policy_version", "resubmitted", "output"):
        lines.append(f"  {k:15s} {s[k]}")
    if s.get("example"):
        lines.append(f"  {'first result':15s} {s['example']!r}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rollout_service.launch", description=" ".join(__doc__.split("\n\n")[0].split()))
    add_run_args(p)
    return p


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="service YAML (see cluster_configs/)")
    p.add_argument("--prompts", help="JSONL prompts file (default: the config's, else the built-in sample set)")
    p.add_argument("--output", help=f"msgpack results file, relative to the current directory (default: the "
                                    f"config's, else {DEFAULT_OUTPUT}); its folder is made if missing")
    p.add_argument("--num-prompts", type=int, help="roll out only the first N prompts (default: the config's "
                                                   "`num_prompts`, else all)")
    p.add_argument("--num-workers", type=int, help="rollout workers (default: the config's `num_workers`)")
    p.add_argument("--max-tokens", type=int, help="new tokens per sample (default: the config's "
                                                  "`sampling.max_tokens`)")


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    overrides: dict = {k: getattr(args, k) for k in ("prompts", "output", "num_prompts", "num_workers")
                       if getattr(args, k) is not None}
    if args.max_tokens is not None:
        overrides["sampling"] = {"max_tokens": args.max_tokens}
    return ServiceConfig.load(args.config, **overrides)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        config = config_from_args(args)
        summary = run(config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ConnectionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_summary(summary), flush=True)
    print("SUMMARY_JSON " + json.dumps({k: v for k, v in summary.items() if k != "per_worker"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
