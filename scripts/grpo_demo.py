"""GRPO through the Ray rollout service: a learner actor trains SmolLM2-135M-Instruct on arithmetic.

    python scripts/grpo_demo.py --config cluster_configs/grpo-local.yaml [--steps 12] [--out DIR]
    python scripts/grpo_demo.py --config cluster_configs/grpo-colocated-gpu.yaml   # learner + worker on one GPU
    python scripts/grpo_demo.py --bitwise   # batch-invariant engine, bitwise learner recompute: ratio exactly 1

The service (router + rollout workers) comes from the YAML; the learner is a Ray actor (actors/grpo.py)
that samples G completions per prompt, updates, and pushes each new policy version to the workers. With
`colocate: true` the learner is placed in worker 0's bundle (its GPU) and the workers sleep while it trains.
Per step it appends to DIR/steps.jsonl: mean reward, held-out greedy accuracy (every --eval-every
steps), the fidelity of the step's rollouts (rollout/learner log-prob mismatch, KL, max ratio), staleness,
rollout tokens/s, the seconds of every phase (rollout, reward, learner, refresh, sleep, wake, idle) and the
learner's memory; at the end it draws DIR/grpo.png and writes DIR/run.json (command, wall time, load
average, before/after accuracy).

--bitwise turns on the engine's batch_invariant mode (on its ops backend, torch or cuda) and the learner's bitwise
recompute (GRPOConfig.bitwise): on-policy, the PPO ratio is then exactly 1 (each row's
ratio_first_minibatch_max_abs_dev is 0.0). The engine runs in the learner's dtype (grpo.dtype).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import yaml
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_service.examples import tasks  # noqa: E402

DEMO_KEYS = ("steps", "eval_every", "heldout_size", "learner_threads", "policy")


def load_config(path: str) -> tuple[dict, dict, dict]:
    """(service config dict, GRPOConfig fields, demo settings) from one YAML."""
    with open(path) as f:
        raw = yaml.safe_load(f)
    grpo = dict(raw.pop("grpo", {}) or {})
    demo = {k: grpo.pop(k) for k in DEMO_KEYS if k in grpo}
    return raw, grpo, demo


def bitwise_settings(service_cfg: dict, grpo_cfg: dict) -> None:
    """--bitwise, in place: a batch-invariant engine in the learner's dtype and a bitwise learner. An engine
    dtype left unset takes the learner's (bitwise log-probs need one dtype); a different one is a ValueError."""
    engine = service_cfg.setdefault("engine", {})
    learner_dtype = grpo_cfg.get("dtype", "float32")
    if engine.get("dtype") not in (None, learner_dtype):
        raise ValueError(f"--bitwise: engine.dtype={engine['dtype']!r} but grpo.dtype={learner_dtype!r}; bitwise "
                         "log-probs need the learner's weights in the engine's dtype: set both alike")
    engine.update(batch_invariant=True, dtype=learner_dtype)
    grpo_cfg["bitwise"] = True


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    ax[0].plot(steps, [r["reward_mean"] for r in rows], "o-", label="mean reward (train batch)")
    ax[0].plot(steps, [r["correct_rate"] for r in rows], "s--", label="correct rate (train batch)")
    ax[0].set_title("reward")
    ev = [(0, rows[0]["heldout_accuracy_before"], rows[0]["heldout_format_before"])] + [
        (r["step"], r["heldout_accuracy"], r["heldout_format_rate"]) for r in rows if r.get("heldout_accuracy") is not None]
    ax[1].plot([e[0] for e in ev], [100 * e[1] for e in ev], "o-", label="accuracy")
    ax[1].plot([e[0] for e in ev], [100 * e[2] for e in ev], "s--", label="well-formed first line")
    ax[1].set_title(f"held-out greedy (%), {rows[0]['heldout_size']} problems")
    ax[2].semilogy(steps, [max(r["mismatch_mean"], 1e-9) for r in rows], "o-", label="mean |Δ logprob|")
    ax[2].semilogy(steps, [max(r["mismatch_max"], 1e-9) for r in rows], "s--", label="max |Δ logprob|")
    ax[2].axhline(1e-4, color="gray", lw=0.8, ls=":", label="1e-4")
    ax[2].set_title("rollout vs learner logprob mismatch")
    for a in ax:
        a.set_xlabel("step (policy version after the update)")
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="cluster_configs/grpo-local.yaml")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--eval-every", type=int)
    ap.add_argument("--out", default="benchmarks/results/grpo-local")
    ap.add_argument("--overlap", action="store_true",
                    help="one-step off-policy: submit the next batch before each update (staleness 1)")
    ap.add_argument("--bitwise", action="store_true",
                    help="batch-invariant engine and the learner's bitwise recompute: the on-policy "
                         "PPO ratio is exactly 1")
    args = ap.parse_args()
    t_start = time.perf_counter()
    service_cfg, grpo_cfg, demo = load_config(args.config)
    if args.bitwise:
        bitwise_settings(service_cfg, grpo_cfg)
    steps = args.steps or demo.get("steps", 12)
    eval_every = args.eval_every or demo.get("eval_every", 4)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import ray
    from actors.grpo import GRPOActor, GRPOConfig
    from rollout_service import RolloutClient

    GRPOConfig(**grpo_cfg)  # bad settings fail here, before any actor starts
    train, heldout = tasks.split(demo.get("heldout_size", 64))
    sampler = tasks.ProblemSampler(train, seed=grpo_cfg.get("seed", 0))
    client = RolloutClient.launch(service_cfg)
    try:
        # colocated: the learner takes the other half of worker 0's bundle (its GPU); else it asks for nothing
        placement = client.colocated_options(0) if service_cfg.get("colocate") else {"num_cpus": 0}
        policy = demo.get("policy") or service_cfg.get("engine", {}).get("model", "smollm2-135m")
        learner = GRPOActor.options(**placement).remote(
            policy, service_cfg["name"], grpo_cfg, namespace=service_cfg.get("namespace", "rollout_service"),
            num_threads=demo.get("learner_threads"))
        rows = run(learner, ray, sampler, heldout, steps, eval_every, grpo_cfg, out, args.overlap)
    finally:
        client.close()
    wall = time.perf_counter() - t_start
    plot(rows, out / "grpo.png")
    evals = [r for r in rows if r.get("heldout_accuracy") is not None]
    summary = {"command": " ".join(shlex.quote(a) for a in [sys.executable.split("/")[-1], *sys.argv]),
               "wall_s": wall, "steps": steps, "overlap": args.overlap, "grpo": grpo_cfg, "service": service_cfg,
               "heldout_size": len(heldout), "accuracy_before": rows[0]["heldout_accuracy_before"],
               "accuracy_after": evals[-1]["heldout_accuracy"] if evals else None,
               "mismatch_step1_full_mean": rows[0].get("mismatch_full_mean"),
               "mismatch_step1_full_max": rows[0].get("mismatch_full_max"),
               "ratio_step1_first_minibatch_max_abs_dev": rows[0].get("ratio_first_minibatch_max_abs_dev"),
               "loadavg_start_end": [rows[0]["loadavg"], rows[-1]["loadavg"]], "cpus": os.cpu_count()}
    (out / "run.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: summary[k] for k in ("wall_s", "accuracy_before", "accuracy_after", "mismatch_step1_full_mean",
                                               "mismatch_step1_full_max", "ratio_step1_first_minibatch_max_abs_dev")}))


def run(learner, ray, sampler, heldout, steps, eval_every, grpo_cfg, out: Path, overlap: bool) -> list[dict]:
    before = ray.get(learner.evaluate.remote(heldout))
    rows = []
    bar = tqdm(range(1, steps + 1), desc="GRPO", unit="step")
    with open(out / "steps.jsonl", "w") as log:
        k = grpo_cfg.get("prompts_per_step", 8)
        problems = sampler.sample(k)
        for step in bar:
            following = sampler.sample(k)
            row = ray.get(learner.step.remote(problems, full_mismatch=step == 1,
                                              prefetch=following if overlap and step < steps else None))
            problems = following
            row["heldout_accuracy"] = row["heldout_format_rate"] = None
            if step % eval_every == 0 or step == steps:
                ev = ray.get(learner.evaluate.remote(heldout))
                row.update(heldout_accuracy=ev["accuracy"], heldout_format_rate=ev["format_rate"],
                           heldout_samples=ev["samples"])
            if step == 1:
                row.update(heldout_accuracy_before=before["accuracy"], heldout_format_before=before["format_rate"],
                           heldout_samples_before=before["samples"], heldout_size=len(heldout))
            row["loadavg"] = os.getloadavg()[0]
            row["time"] = time.time()
            log.write(json.dumps(row) + "\n")
            log.flush()
            rows.append(row)
            bar.set_postfix(reward=f"{row['reward_mean']:.2f}", acc=row["heldout_accuracy"],
                            mm=f"{row['mismatch_mean']:.1e}")
    return rows


if __name__ == "__main__":
    main()
