"""`rollout-service` console script.

    rollout-service run --config cluster_configs/local-cpu.yaml   # local Ray, roll out prompts, summary
    rollout-service serve --config cluster_configs/local-cpu.yaml # a named service that outlives the command
    rollout-service serve --config ... --openai                   # ... and an OpenAI endpoint in front of it
    rollout-service serve --config ... --openai-replicas 4        # ... served by 4 Ray Serve replicas
    rollout-service stats [--name N] [--wide | --json]            # per-worker stats of a running service
    rollout-service scale --num-workers N [--name N]              # add or remove workers of a running service
    rollout-service stop [--name N]                               # shut a running service down
    rollout-service bench [...]                                   # the benchmark harness
    rollout-service build-kernels                                 # compile the CUDA kernels ahead of time
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rollout_service import launch
from rollout_service.config import ServiceConfig

console = Console()
DEFAULT_NAME = DEFAULT_NAMESPACE = "rollout_service"  # ServiceConfig's defaults for `name` and `namespace`


def cmd_run(args: argparse.Namespace) -> int:
    config = launch.config_from_args(args)
    prepared = launch.prepare(config)  # bad prompts, output or model: one line, before anything starts
    # transient, and none off a terminal: a start-up failure prints one error line, no bar or blank line above it
    with Progress(TextColumn("[bold]rollout"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[tokens]} tokens"), console=console, transient=True,
                  disable=not console.is_terminal) as bar:
        task = bar.add_task("rollout", total=None, tokens=0)

        def on_result(r) -> None:
            bar.update(task, advance=1, tokens=bar.tasks[task].fields["tokens"] + len(r.token_ids))

        console.print(f"starting {_workers_text(config)} of {config.engine.model!s} ...", soft_wrap=True)
        summary = launch.run(config, on_result=on_result, on_start=lambda n: bar.update(task, total=n),
                             prepared=prepared)
    console.print(summary_table(summary))
    if summary.get("example"):
        console.print(f"first result: {summary['example']!r}")
    console.print(f"results: {summary['output']}", soft_wrap=True)
    return 0


def _workers_text(config: ServiceConfig) -> str:
    return "one worker per GPU" if config.num_workers == "auto" else f"{config.num_workers} worker(s)"


SUMMARY_ROWS = (("prompts", "prompts"), ("samples", "samples"), ("prompt_tokens", "prompt tokens"),
                ("output_tokens", "output tokens"), ("startup_s", "start-up (s)"), ("rollout_s", "rollout (s)"),
                ("tokens_per_s", "output tokens/s"), ("workers", "workers"), ("policy_version", "policy version"),
                ("resubmitted", "resubmitted requests"))


def summary_table(s: dict) -> Table:
    # The two rates differ by design, so the caption says how each is measured: the total over the whole
    # rollout's wall time, each worker's over its own recent busy steps (they sum to more than the total).
    t = Table(title="rollout metrics", show_header=True,
              caption="output tokens/s = output tokens / rollout (s): all workers, wall time from the workers "
                      "being ready to the last result. A worker's tokens/s is its engine's rate over its last "
                      "64 steps, while generating; idle time and start-up are not in it, so the workers' rates "
                      "add up to more than the total.", caption_justify="left")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k, label in SUMMARY_ROWS:
        t.add_row(label, str(s[k]))
    t.add_row("finish reasons", ", ".join(f"{k}={v}" for k, v in sorted(s["finish_reasons"].items())))
    for w in s.get("per_worker", []):
        tps = w.get("tokens_per_s")
        t.add_row(f"worker {w['worker']} tokens/s (last 64 steps)", "dead" if tps is None else f"{tps:.1f}")
    return t


def cmd_serve(args: argparse.Namespace) -> int:
    """Launch a detached service on a Ray cluster that outlives this command, print how to use it, exit."""
    from rollout_service.model.loader import check_source_here

    if args.openai_replicas:
        _check_replicas(args.openai_replicas)
        args.openai = True
    overrides = {k: v for k, v in (("name", args.name), ("num_workers", args.num_workers),
                                   ("address", args.address)) if v is not None}
    config = ServiceConfig.load(args.config, detached=True, **overrides)  # before Ray is imported: a bad
    check_source_here(config.engine.model, local=False)                   # config is one line at once
    import ray

    from rollout_service.connections.ray import RayConnection

    # the cluster started by hand on this machine (`ray start --head`) unless one is named
    address = config.address or os.environ.get("RAY_ADDRESS") or "auto"
    console.print(f"starting {_workers_text(config)} of {config.engine.model!s} ...", soft_wrap=True)
    backend = RayConnection.start_service(config, address=address)
    gcs = ray.get_runtime_context().gcs_address
    flags, kwargs = "", ""
    if config.name != DEFAULT_NAME:
        flags = f" --name {config.name}"
    if config.namespace != DEFAULT_NAMESPACE:
        flags, kwargs = f"{flags} --namespace {config.namespace}", f"{kwargs}, namespace={config.namespace!r}"
    # Always the address: with several Ray clusters on one machine, "auto" finds the latest, maybe another's.
    flags, kwargs = f"{flags} --address {gcs}", f"{kwargs}, address={gcs!r}"
    console.print(f"rollout service {config.name!r} is serving on the Ray cluster at {gcs}; it keeps running "
                  f"after this command.\n"
                  f"  stats:    rollout-service stats{flags}\n"
                  f"  connect:  RolloutClient.connect({config.name!r}{kwargs})   # from a learner\n"
                  f"  stop:     rollout-service stop{flags}", soft_wrap=True, highlight=False)
    if args.openai:
        return _serve_openai(args, config, backend)
    return 0


def _check_replicas(n: int) -> None:
    """Refuse --openai-replicas before the service starts, not after."""
    if n < 0:
        raise ValueError(f"--openai-replicas {n}: must be >= 0 (0: one endpoint process in the foreground)")
    from rollout_service.openai.replicas import serve_module
    serve_module()


def _serve_openai(args: argparse.Namespace, config: ServiceConfig, backend) -> int:
    """The OpenAI endpoint in front of the service just started: Ray Serve replicas that outlive this command
    (--openai-replicas), else one process in the foreground until Ctrl-C (the service keeps running after it,
    as without --openai)."""
    from rollout_service.client import RolloutClient
    from rollout_service.openai import serve_openai
    from rollout_service.openai.auth import default_token_file
    from rollout_service.openai.server import tokenizer_for

    token_file = Path(args.openai_token_file).expanduser() if args.openai_token_file else default_token_file()
    if args.openai_replicas:
        from rollout_service.openai.replicas import serve_openai_replicas

        eps = serve_openai_replicas(RolloutClient(backend), args.openai_replicas, host=args.openai_host,
                                    port=args.openai_port, token_file=token_file, model_name=str(config.engine.model))
        console.print(f"OpenAI endpoint: {eps.url} ({eps.replicas} Ray Serve replicas; bearer token in {token_file}); "
                      f"it keeps running after this command, `rollout-service stop` removes it", soft_wrap=True,
                      highlight=False)
        return 0
    console.print(f"OpenAI endpoint: http://{args.openai_host}:{args.openai_port}/v1 (bearer token in "
                  f"{token_file}); Ctrl-C stops it, not the service", soft_wrap=True, highlight=False)
    serve_openai(RolloutClient(backend), host=args.openai_host, port=args.openai_port, token_file=token_file,
                 tokenizer=tokenizer_for(config.engine.model), model_name=str(config.engine.model), block=True)
    return 0


# (header, how to read it from one worker's stats): the default set fits an 80-column terminal
STATS_COLUMNS = (
    ("worker", lambda s: s.get("worker")),
    ("alive", lambda s: s.get("alive")),
    ("queued", lambda s: s.get("queued")),
    ("running", lambda s: s.get("running")),
    ("KV pages\nused/total", lambda s: _ratio(s.get("kv_pages_used"), s.get("kv_pages_total"))),
    ("tok/s", lambda s: s.get("tokens_per_s")),
    ("policy\nversion", lambda s: s.get("policy_version")),
)
WIDE_COLUMNS = (
    ("sleep\nlevel", lambda s: s.get("sleep_level")),
    ("device\nMiB", lambda s: _mib(s.get("device_memory_bytes"))),
    ("generated\ntokens", lambda s: s.get("generated_tokens")),
    ("prefilled\ntokens", lambda s: s.get("prefilled_tokens")),
    ("prefix\nhit %", lambda s: _percent((s.get("prefix_cache") or {}).get("hit_rate"))),
    ("preemptions", lambda s: s.get("preemptions")),
    ("spec\naccept %", lambda s: _percent(_speculative(s).get("acceptance_rate"))),
    ("tokens per\nverify step", lambda s: _speculative(s).get("tokens_per_verify")),
    ("device", lambda s: s.get("device")),
    ("backend", lambda s: s.get("backend")),
    ("node", lambda s: (s.get("node_id") or "")[:8] or None),
)


def _speculative(s: dict) -> dict:
    """A worker's speculative-decoding figures, empty where it is off (EngineConfig.speculative)."""
    spec = s.get("speculative") or {}
    return spec if spec.get("enabled") else {}


def _ratio(used, total) -> str | None:
    return None if used is None or total is None else f"{used}/{total}"


def _mib(n) -> float | None:
    return None if n is None else n / 2**20


def _percent(rate) -> float | None:
    return None if rate is None else 100 * rate


def _cell(v) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def cmd_stats(args: argparse.Namespace) -> int:
    from rollout_service.connections.ray import RayConnection
    backend = RayConnection.connect(args.name, namespace=args.namespace, address=args.address)
    stats, info = backend.stats(), backend.info()
    if args.json:
        # plain print: rich would highlight and wrap it, and a pipe wants the bytes as they are
        print(json.dumps({"name": args.name, "namespace": args.namespace, "info": info, "workers": stats},
                         default=str))
        return 0
    columns = STATS_COLUMNS + (WIDE_COLUMNS if args.wide else ())
    t = Table(title=f"service {args.name!r}: policy version {info['policy_version']}, "
                    f"{info['in_flight']} in flight",
              caption="tok/s: output tokens per second of each engine over its last 64 steps"
                      + ("" if args.wide else "; --wide for memory, token counts, device; --json for all"),
              caption_justify="left")
    for header, _ in columns:
        t.add_column(header, justify="right")
    for s in stats:
        t.add_row(*(_cell(read(s)) for _, read in columns))
    if args.wide:  # every column at full width, however narrow the terminal: the user asked for them
        out = Console(width=max(console.width, Measurement.get(console, console.options.update_width(1000), t).maximum))
        out.print(t)
    else:
        console.print(t)
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    from rollout_service.connections.ray import RayConnection
    from rollout_service.client import RolloutClient
    client = RolloutClient(RayConnection.connect(args.name, namespace=args.namespace, address=args.address))
    before = client.info()["num_workers"]
    client.scale(args.num_workers, drain_s=args.drain_s, timeout_s=args.timeout_s)
    info = client.info()
    console.print(f"rollout service {args.name!r}: {before} -> {info['num_workers']} worker(s), "
                  f"{sum(info['alive'])} serving", highlight=False)
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from rollout_service.connections.ray import RayConnection, stop_openai_app

    conn = RayConnection.connect(args.name, namespace=args.namespace, address=args.address)
    if stop_openai_app(args.name):  # (shutdown would too, first: its replicas are the service's clients)
        console.print(f"stopped the OpenAI endpoint of {args.name!r}")
    conn.shutdown()
    console.print(f"stopped rollout service {args.name!r}")
    return 0


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    """The harness lives beside the package in the repository (benchmarks/), not in what pip installs: it runs
    from the checkout this package was installed from, in a process of its own, in the current directory."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "benchmarks" / "harness").is_dir():
        print_error(ValueError("the benchmark harness is in the repository (benchmarks/), not in the installed "
                               "package: run `python -m benchmarks` in a checkout"))
        return 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    code = "import sys; from benchmarks.harness import main; sys.exit(main(sys.argv[1:], prog='rollout-service bench'))"
    return subprocess.run([sys.executable, "-c", code, *rest], env=env).returncode


def cmd_build_kernels(args: argparse.Namespace) -> int:
    from rollout_service.ops._ext import CudaUnavailable, build_kernels
    try:
        build_kernels()
    except CudaUnavailable as e:  # a fact about the machine: one line (a compiler failure keeps its traceback)
        print_error(e)
        return 1
    console.print("CUDA kernels built (or found in the cache)")
    return 0


def add_service_args(p: argparse.ArgumentParser) -> None:
    """Which running service: its name and namespace, on which Ray cluster."""
    p.add_argument("--name", default=DEFAULT_NAME, help="the service's name (default: %(default)s)")
    p.add_argument("--namespace", default=DEFAULT_NAMESPACE,
                   help="the Ray namespace it was started in, the config's `namespace` (default: %(default)s)")
    p.add_argument("--address", default=None,
                   help="Ray cluster (default: $RAY_ADDRESS, else the one `ray start --head` runs on this machine)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollout-service", description="distributed rollout service for RL")
    sub = p.add_subparsers(dest="command", required=True)
    launch.add_run_args(sub.add_parser("run", help="start a local service, roll out prompts, print a summary"))
    sv = sub.add_parser("serve", help="start a named service on a running Ray cluster (`ray start --head`); "
                                      "it outlives this command")
    sv.add_argument("--config", required=True, help="service YAML (see cluster_configs/)")
    sv.add_argument("--name", help=f"the service's name (default: the config's `name`, else {DEFAULT_NAME})")
    sv.add_argument("--num-workers", type=int, help="rollout workers (default: the config's `num_workers`)")
    sv.add_argument("--address", help="Ray cluster (default: the config's, else $RAY_ADDRESS, else the one "
                                      "`ray start --head` runs on this machine)")
    sv.add_argument("--openai", action="store_true",
                    help="then serve an OpenAI-compatible endpoint in front of it, in the foreground (docs/openai.md)")
    sv.add_argument("--openai-host", default="127.0.0.1", help="the endpoint's address (default: %(default)s)")
    sv.add_argument("--openai-port", type=int, default=8000, help="the endpoint's port (default: %(default)s)")
    sv.add_argument("--openai-token-file", help="where the endpoint's new bearer token is written, mode 0600 "
                                                "(default: ~/.rollout_service/openai_token)")
    sv.add_argument("--openai-replicas", type=int, default=0,
                    help="serve the endpoint as this many Ray Serve replicas behind Serve's proxy on every node, "
                         "outliving this command (needs ray[serve]); 0: one process, in the foreground (default)")
    st = sub.add_parser("stats", help="per-worker stats of a running service")
    add_service_args(st)
    shape = st.add_mutually_exclusive_group()
    shape.add_argument("--wide", action="store_true", help="more columns: memory, token counts, prefix cache, "
                                                            "speculative decoding, device, node (wider than 80 columns)")
    shape.add_argument("--json", action="store_true", help="every counter of the service and its workers, as JSON")
    sc = sub.add_parser("scale", help="add or remove workers of a running service (removed ones drain first)")
    add_service_args(sc)
    sc.add_argument("--num-workers", type=int, required=True, help="workers from now on (gone ones are replaced)")
    sc.add_argument("--drain-s", type=float, default=60.0,
                    help="seconds a removed worker may finish its requests before it hands the rest to the others "
                         "(default: %(default)s)")
    sc.add_argument("--timeout-s", type=float, default=None,
                    help="seconds to place and start new workers before giving up, the service unchanged "
                         "(default: the config's placement.timeout_s)")
    add_service_args(sub.add_parser("stop", help="shut a running service down"))
    sub.add_parser("bench", help="benchmark harness (arguments are passed through)", add_help=False)
    sub.add_parser("build-kernels", help="compile the CUDA kernels into the cache")
    return p


COMMANDS = {"run": cmd_run, "serve": cmd_serve, "stats": cmd_stats, "scale": cmd_scale, "stop": cmd_stop,
            "build-kernels": cmd_build_kernels}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # everything after `bench` belongs to the benchmark's own parser
        return cmd_bench(argparse.Namespace(), argv[1:])
    args = parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ValueError, ConnectionError) as e:
        print_error(e)
        return 2 if isinstance(e, ValueError) else 1


def print_error(e: BaseException) -> None:
    # soft_wrap: a path in the message must stay copyable, not be broken at the terminal width;
    # escape: brackets in the message (shapes, lists) are text, not rich markup
    console.print(f"[red]error:[/red] {escape(str(e))}", soft_wrap=True)


if __name__ == "__main__":
    sys.exit(main())
