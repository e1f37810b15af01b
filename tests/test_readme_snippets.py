"""The Python snippets of the README and docs/ marked `<!-- snippet: NAME -->` run as written, given the objects
the text around them names (a client, prompts, a policy), here on tiny random models; each test then checks what
the snippet's comments claim. Every ```python block of the docs must be such a snippet, run by a test here or in
tests/test_docs_*.py (test_every_python_block_is_a_tested_snippet)."""
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
SNIPPET_TESTS = [Path(__file__).resolve(), *sorted((REPO / "tests").glob("test_docs_*.py"))]
MARKER = re.compile(r"<!-- snippet: (\S+)\b.*?-->")


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


def test_every_python_block_is_a_tested_snippet():
    """Each ```python block is right after its marker, each marker right before a ```python block, and each
    marked snippet is run by a test: its name is the first argument of a run(...) or snippet(...) call in this
    module or a tests/test_docs_*.py one."""
    unmarked, stray, names = [], [], []
    for path in DOCS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            where = f"{path.relative_to(REPO)}:{i + 1}"
            if re.match(r"\s*```\s*py(thon)?\b", line, re.I):
                marker = MARKER.fullmatch(lines[i - 1].strip()) if i else None
                if marker:
                    names.append(marker.group(1))
                else:
                    unmarked.append(where)
            elif "<!-- snippet:" in line and not (i + 1 < len(lines) and lines[i + 1].strip() == "```python"):
                stray.append(where)
    assert not unmarked, f"```python blocks without a `<!-- snippet: NAME -->` line before them: {unmarked}"
    assert not stray, f"snippet markers not followed by a ```python block: {stray}"
    sources = "\n".join(p.read_text() for p in SNIPPET_TESTS)
    untested = [n for n in names if not re.search(rf"\b(run|snippet)\(\s*\"{re.escape(n)}\"", sources)]
    assert not untested, f"snippets no test runs: {untested}"
    assert len(names) >= 19, names


def test_tour_snippet():
    """The README's tour (and the Learner API page's first example, the same code), on the embedded model as
    written: results prompt-major with their log-probs and top alternatives, a score, a refresh to version 1."""
    scope = run("tour")
    results, scored = scope["results"], scope["scored"]
    assert len(results) == 12 and [r.sample_index for r in results] == [0, 1, 2, 3] * 3
    assert len({tuple(r.prompt_token_ids) for r in results}) == 3 and results[8].prompt_token_ids == [1, 9690, 198]
    for r in results:
        assert 0 < len(r.token_ids) == len(r.logprobs) == len(r.top_logprobs) <= 64 and np.all(r.logprobs <= 0)
        assert all(len(top) == 2 for top in r.top_logprobs) and isinstance(r.text, str) and r.finish_reason in (
            "stop", "length")
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
