"""The Python snippets of the README and docs/ marked `<!-- snippet: NAME -->` run as written, given the objects
the text around them names (a client, prompts, a policy), here on tiny random models; each test then checks what
the snippet's comments claim."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from test_engine import prompts
from test_moe import moe_model
from tiny_models import tiny_hf_model

from rollout_service import RolloutClient

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def docs_text() -> str:
    return "\n".join(path.read_text() for path in DOCS)


def snippet(name: str) -> str:
    """The fenced python block right after `<!-- snippet: name ... -->`."""
    found = re.search(rf"<!-- snippet: {re.escape(name)}\b.*?-->\n```python\n(.*?)```", docs_text(), re.S)
    assert found, f"the docs have no snippet {name!r}"
    return found.group(1)


def run(name: str, **given) -> dict:
    scope = dict(given)
    exec(compile(snippet(name), f"snippet {name!r}", "exec"), scope)  # noqa: S102 - our own docs
    return scope


def test_snippet_names_are_unique():
    names = re.findall(r"<!-- snippet: (\S+)", docs_text())
    assert len(names) == len(set(names)) >= 3, names


def test_tour_snippet():
    """The README's tour, on the embedded model as written: results, a score, a refresh to version 1."""
    scope = run("tour")
    results, scored = scope["results"], scope["scored"]
    assert len(results) == 12 and [r.sample_index for r in results[:4]] == [0, 1, 2, 3]
    assert scored[0].finish_reason == "scored" and scored[0].token_ids == results[0].token_ids
    assert all(v == 0 for v in scored[0].token_versions)  # scored before the refresh to version 1


def test_score_snippet():
    with RolloutClient.local(tiny_hf_model(), backend="torch", dtype="float32", device="cpu", num_pages=256) as client:
        scope = run("score", client=client, prompts=prompts(2, seed=4))
    rollouts, ref = scope["rollouts"], scope["ref"]
    assert len(ref) == len(rollouts) == 16  # one scored result per rollout, "same order"
    for r, s in zip(rollouts, ref):
        assert s.finish_reason == "scored" and s.token_ids == r.token_ids and s.token_versions == [0] * len(r.token_ids)
        np.testing.assert_allclose(s.logprobs, r.logprobs, atol=1e-4)  # the same policy, scored after the fact


def test_moe_snippet():
    policy = moe_model("qwen3_moe", seed=1)
    with RolloutClient.local(policy, backend="torch", dtype="bfloat16", device="cpu", num_pages=256) as client:
        scope = run("moe", client=client, prompts=prompts(3, seed=2, lo=4, hi=30), policy=policy)
    results = scope["results"]
    assert len(results) == 12 and all(r.routed_experts is not None for r in results)
    assert torch.isfinite(scope["loss"]) and scope["loss"].item() > 0
    grads = [p.grad for n, p in policy.named_parameters() if "mlp.gate" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)  # the routers learn through replay
