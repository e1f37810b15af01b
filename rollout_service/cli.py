"""`rollout-service` console script.

    rollout-service run --config cluster_configs/local-cpu.yaml   # local Ray, roll out prompts, summary
    rollout-service stats [--name rollout_service]                # per-worker stats of a running service
    rollout-service bench [...]                                   # the benchmark harness
    rollout-service build-kernels                                 # compile the CUDA kernels ahead of time
"""
from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rollout_service import launch

console = Console()


def cmd_run(args: argparse.Namespace) -> int:
    config = launch.config_from_args(args)
    with Progress(TextColumn("[bold]rollout"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[tokens]} tokens"), console=console, transient=False) as bar:
        task = bar.add_task("rollout", total=None, tokens=0)

        def on_result(r) -> None:
            bar.update(task, advance=1, tokens=bar.tasks[task].fields["tokens"] + len(r.token_ids))

        console.print(f"starting {config.num_workers} worker(s) of {config.engine.model!s} ...")
        summary = launch.run(config, on_result=on_result, on_start=lambda n: bar.update(task, total=n))
    console.print(summary_table(summary))
    if summary.get("example"):
        console.print(f"first result: {summary['example']!r}")
    return 0


def summary_table(s: dict) -> Table:
    t = Table(title="rollout metrics", show_header=True)
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k in ("prompts", "samples", "prompt_tokens", "output_tokens", "startup_s", "rollout_s", "tokens_per_s",
              "workers", "policy_version", "resubmitted", "output"):
        t.add_row(k, str(s[k]))
    t.add_row("finish_reasons", ", ".join(f"{k}={v}" for k, v in sorted(s["finish_reasons"].items())))
    for w in s.get("per_worker", []):
        tps = w.get("tokens_per_s")
        t.add_row(f"worker {w['worker']} tokens/s", "dead" if tps is None else f"{tps:.1f}")
    return t


def cmd_stats(args: argparse.Namespace) -> int:
    from rollout_service.service import RayBackend
    backend = RayBackend.connect(args.name, namespace=args.namespace, address=args.address)
    stats, info = backend.stats(), backend.info()
    t = Table(title=f"service {args.name!r}: policy version {info['policy_version']}, "
                    f"{info['in_flight']} request(s) in flight")
    cols = ("worker", "alive", "queued", "running", "kv_pages_used", "kv_pages_total", "tokens_per_s",
            "policy_version", "sleep_level", "device_MiB")
    for c in cols:
        t.add_column(c, justify="right")
    for s in stats:
        mem = s.get("device_memory_bytes")
        s = {**s, "device_MiB": None if mem is None else mem / 2**20}
        t.add_row(*(f"{v:.1f}" if isinstance(v, float) else str(v) for v in (s.get(c) for c in cols)))
    console.print(t)
    return 0


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    from rollout_service.bench import main as bench_main
    return int(bench_main(rest) or 0)


def cmd_build_kernels(args: argparse.Namespace) -> int:
    from rollout_service.ops._ext import build_kernels
    build_kernels()
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollout-service", description="distributed rollout service for RL")
    sub = p.add_subparsers(dest="command", required=True)
    launch.add_run_args(sub.add_parser("run", help="start a local service, roll out prompts, print a summary"))
    st = sub.add_parser("stats", help="per-worker stats of a running service")
    st.add_argument("--name", default="rollout_service")
    st.add_argument("--namespace", default="rollout_service")
    st.add_argument("--address", default=None, help="Ray address (default: $RAY_ADDRESS or the local cluster)")
    sub.add_parser("bench", help="benchmark harness (arguments are passed through)", add_help=False)
    sub.add_parser("build-kernels", help="compile the CUDA kernels into the cache")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # everything after `bench` belongs to the benchmark's own parser
        return cmd_bench(argparse.Namespace(), argv[1:])
    args = parser().parse_args(argv)
    try:
        if args.command == "run":
            return cmd_run(args)
        if args.command == "stats":
            return cmd_stats(args)
        return cmd_build_kernels(args)
    except ValueError as e:
        # soft_wrap: a path in the message must stay copyable, not be broken at the terminal width;
        # escape: brackets in the message (shapes, lists) are text, not rich markup
        console.print(f"[red]error:[/red] {escape(str(e))}", soft_wrap=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
