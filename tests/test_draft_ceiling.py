"""The drafter ceiling's replay (benchmarks/harness/draft_ceiling.py) on token lists whose answer is known: no
model, no sampling."""
from __future__ import annotations

from benchmarks.harness.draft_ceiling import DRAFTERS, _Replay, replay_all
from rollout_service.engine import drafter as drafting

PROMPTS = {0: [1, 2, 3], 1: [1, 2, 4]}
TEXT = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]


def _replay(every_prompt: bool, epochs: list[list[tuple[int, list[int]]]], noise: bool = True,
            dists: bool = False) -> list[dict]:
    replay = _Replay(every_prompt, noise, dists)
    return [replay.epoch(PROMPTS, _drawn(samples), k=4) for samples in epochs]


def _drawn(samples: list[tuple[int, list[int]]]) -> list[tuple]:
    """(prompt, tokens) with a seed and sample index each (the draws a noise-following drafter looks at) and each
    token's distribution: the token itself, certain."""
    return [(prompt, tokens, 5, i, [([t], [0.0]) for t in tokens]) for i, (prompt, tokens) in enumerate(samples)]


def test_every_token_is_counted_once_and_a_step_takes_at_least_one():
    samples = [(0, TEXT), (0, TEXT[:5] + [30, 31]), (1, [40, 41, 42])]
    for every_prompt, _, noise, dists in DRAFTERS.values():
        (c,) = _replay(every_prompt, [samples], noise, dists)
        assert c["tokens"] == sum(len(t) for _, t in samples)
        assert c["steps"] <= c["tokens"] and c["accepted"] == c["tokens"] - c["steps"]
        assert c["accepted"] <= c["proposed"]


def test_text_seen_in_an_earlier_epoch_is_drafted_and_kept():
    cold, warm = _replay(False, [[(0, TEXT)], [(0, TEXT)]])
    assert cold["accepted"] == 0  # nothing repeats within the text itself
    assert warm["accepted"] > 0 and warm["steps"] < cold["steps"]
    # its tokens never seen for this prompt: the engine's drafter proposes nothing; one table of every prompt does
    (other,) = _replay(False, [[(0, TEXT)], [(1, TEXT)]])[1:]
    assert other["drafts"] == 0
    (shared,) = _replay(True, [[(0, TEXT)], [(1, TEXT)]])[1:]
    assert shared["accepted"] > 0


def test_one_token_suffixes_draft_where_two_token_ones_have_nothing():
    # 12 follows 11 twice before; the pair (25, 11) is new, so only a one-token suffix finds what follows 11
    epochs = [[(0, [11, 12, 50, 11, 12, 51])], [(0, [60, 25, 11, 12, 70])]]
    rows = {(r["drafter"], r["epoch"]): r for r in replay_all(PROMPTS, [_drawn(e) for e in epochs], k=4)}
    assert rows[("+ 1-token suffixes", 1)]["accepted"] > rows[("+ every prompt", 1)]["accepted"]
    assert DRAFTERS["engine"][1] == drafting.MIN_NGRAM == 2


def test_a_quick_run_samples_the_embedded_model_and_replays_every_drafter(tmp_path):
    """The harness end to end (--quick: 2 prompts x 2 samples, 8 tokens, 2 epochs): a row per drafter and epoch,
    each epoch's tokens counted once by every drafter, the sampled total in the file's meta."""
    import json

    from benchmarks.harness.draft_ceiling import main
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-draft-ceiling.json")
    doc = json.loads(path.read_text())
    rows = doc["rows"]
    assert {(r["drafter"], r["epoch"]) for r in rows} == {(d, e) for d in DRAFTERS for e in (0, 1)}
    for e in (0, 1):
        assert len({r["tokens"] for r in rows if r["epoch"] == e}) == 1
    assert sum(r["tokens"] for r in rows if r["drafter"] == "engine") == doc["meta"]["sampled"]["tokens"] > 0
