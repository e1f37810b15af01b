"""Bad input at every boundary is a ValueError naming what is wrong, raised in the caller's process (the
client, the checks the router calls, Engine.add_request), and a failure inside an engine step finishes
only the request at fault (its batch mates go on with the same tokens). Tiny random models throughout."""
import pickle

import numpy as np
import pytest
from tiny_models import tiny_hf_model

from rollout_service import RolloutClient, RolloutRequest, RolloutResult, SamplingParams
from rollout_service.engine.engine import Engine

SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=7, ignore_eos=True)

# Values the red team set on a SamplingParams after construction: each crashed a step, gave NaN log-probs
# or (n=0) never finished.
MUTATIONS = [("top_k", 0), ("logprobs", -1), ("logprobs_mode", "bogus"), ("seed", -1),
             ("temperature", float("nan")), ("repetition_penalty", 0), ("n", 0), ("stop", None)]


@pytest.fixture(scope="module")
def llama():
    return tiny_hf_model("llama")


@pytest.fixture(scope="module")
def client(llama):
    return RolloutClient.local(llama, num_pages=128)


def mutated(field: str, value) -> SamplingParams:
    sp = SamplingParams(max_tokens=4, seed=1)
    setattr(sp, field, value)
    return sp


# ---- item 13: a SamplingParams changed after construction -------------------------------------------------
@pytest.mark.parametrize("field,value", MUTATIONS)
def test_mutated_params_rejected_by_the_local_client(client, field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        client.generate([[1, 2, 3]], mutated(field, value))
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        client.generate([RolloutRequest([1, 2, 3], mutated(field, value))])
    assert not client.engine.has_unfinished()
    assert client.generate([[1, 2, 3]], SEEDED)[0].finish_reason == "length"  # still serving


@pytest.mark.parametrize("field,value", MUTATIONS)
def test_mutated_params_rejected_by_engine_add_request(llama, field, value):
    eng = Engine(model_source=llama, num_pages=64)
    with pytest.raises(ValueError, match=f"request 'r': SamplingParams.{field}="):
        eng.add_request(RolloutRequest([1, 2, 3], mutated(field, value), request_id="r"))
    assert not eng.has_unfinished()


@pytest.mark.parametrize("field,value", MUTATIONS)
def test_router_check_catches_mutations_that_crossed_a_process(field, value):
    """The router receives requests pickled (pickle skips __post_init__): validated() checks them again."""
    req = pickle.loads(pickle.dumps(RolloutRequest([1, 2, 3], mutated(field, value))))
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        req.validated()
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        req.sampling.validate()


def test_engine_keeps_its_own_copy_of_what_it_accepted(llama):
    """A caller changing a request after add_request cannot reach a step: same tokens as untouched."""
    want = Engine(model_source=llama, num_pages=64)
    want.add_request(RolloutRequest([5, 6, 7], SEEDED, request_id="r"))
    expected = want.run_until_done()
    eng = Engine(model_source=llama, num_pages=64)
    req = RolloutRequest([5, 6, 7], SamplingParams(**SEEDED.to_dict()), request_id="r")
    eng.add_request(req)
    eng.step()
    for field, value in MUTATIONS:
        setattr(req.sampling, field, value)
    req.prompt.append(10**9)
    got = eng.run_until_done()
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert np.isfinite(got[0].logprobs).all()


def test_validated_copy_is_independent():
    req = RolloutRequest([{"role": "user", "content": "hi"}], SamplingParams(stop=["x"]), metadata={"gt": 1})
    copy = req.validated()
    req.prompt[0]["content"] = "changed"
    req.sampling.stop.append("y")
    assert copy.prompt == [{"role": "user", "content": "hi"}] and copy.sampling.stop == ["x"]
    assert copy.metadata is req.metadata and copy.request_id == req.request_id


# ---- item 14: unclear or silent errors ------------------------------------------------------------------
ODD_VALUES = [None, 0, -1, 1, 7, 2**31, 2**63, 10**400, -10**400, 1.5, float("nan"), float("inf"), 1e-300, 1e-40,
              "", "a", "\ud800", b"x", [], [""], [1], ["a", 1], [None], {}, {"a": 1}, {"a"}, (1,), True,
              np.int64(3), np.float32(0.5), np.array([1, 2]), 1j, object(), [[1]], [2**40], ["\udfff"]]


def _fuzzed_kwargs(rng: np.random.Generator) -> tuple[type, dict]:
    def pick():
        return ODD_VALUES[rng.integers(len(ODD_VALUES))]

    if rng.random() < 0.5:
        names = list(SamplingParams.__dataclass_fields__)
        return SamplingParams, {names[rng.integers(len(names))]: pick() for _ in range(rng.integers(1, 4))}
    kw = {"prompt": pick() if rng.random() < 0.6 else [{"role": pick(), "content": pick()}]}
    for name in ("request_id", "apply_chat_template", "sampling"):
        if rng.random() < 0.4:
            kw[name] = pick()
    return RolloutRequest, kw


def test_fuzzed_construction_is_a_value_error_naming_the_field_or_a_usable_object():
    rng = np.random.default_rng(0)
    accepted = 0
    for _ in range(1000):
        cls, kw = _fuzzed_kwargs(rng)
        try:
            obj = cls(**kw)
        except ValueError as e:
            assert str(e).startswith(cls.__name__), (kw, str(e))
            continue
        accepted += 1
        # accepted means usable downstream: the wire format and the boundaries' checks take it
        back = type(obj).from_dict(obj.to_dict()) if cls is SamplingParams else \
            RolloutRequest.from_msgpack(obj.to_msgpack())
        assert back.to_dict() == obj.validated().to_dict()
    assert 0 < accepted < 1000


@pytest.mark.parametrize("make,match", [
    (lambda: SamplingParams(stop=None), "SamplingParams.stop="),
    (lambda: SamplingParams(stop_token_ids=5), "SamplingParams.stop_token_ids="),
    (lambda: SamplingParams(temperature=10**400), "SamplingParams.temperature="),
    (lambda: SamplingParams(temperature=1e-40), "SamplingParams.temperature="),
    (lambda: SamplingParams(max_tokens=2**40), "SamplingParams.max_tokens="),
    (lambda: SamplingParams.from_dict(5), "SamplingParams: expected a dict"),
    (lambda: RolloutRequest.from_dict({"prompt": [1], "samplng": {"n": 2}}), r"unknown field\(s\) \['samplng'\]"),
    (lambda: RolloutRequest.from_dict({"prompt": [1], "sampling": 7}), "SamplingParams: expected a dict"),
    (lambda: RolloutRequest.from_dict({"prompt": [1], "request_id": ""}), "RolloutRequest.request_id"),
    (lambda: RolloutRequest([1], apply_chat_template="no"), "RolloutRequest.apply_chat_template"),
    (lambda: RolloutRequest([1, 2**31]), "RolloutRequest.prompt: token id"),
])
def test_bad_construction_names_the_field(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("call,match", [
    (lambda c: c.stream(None), "prompts: expected"),
    (lambda c: c.generate(5), "prompts: expected"),
    (lambda c: c.generate([]), "prompts: the list is empty"),
    (lambda c: c.generate([[1, 2]], metadata=3), "metadata"),
    (lambda c: c.generate([[1, 2]], sampling={"n": 2}), "sampling: expected a SamplingParams"),
    (lambda c: c.update_weights(5, 1), "update_weights: expected a dict"),
    (lambda c: c.update_weights({}, 1, partial="yes"), "partial"),
    (lambda c: c.abort(None), "abort: request_ids"),
    (lambda c: c.abort("abc"), r"abort: request_ids .* got str \(wrap one id in a list\)"),
    (lambda c: c.abort([1]), "abort: request id 1"),
])
def test_bad_client_arguments_name_the_argument(client, call, match):
    with pytest.raises(ValueError, match=match):
        call(client)
    assert client.generate([[1, 2, 3]], SEEDED)[0].finish_reason == "length"


def test_closed_client_says_so(llama):
    c = RolloutClient.local(llama, num_pages=32)
    c.close()
    for call in (lambda: c.stream([[1]]), lambda: c.generate([[1]]), lambda: c.abort(["x"]), c.stats,
                 lambda: c.update_weights({}, 1)):
        with pytest.raises(ValueError, match="closed"):
            call()
    c.close()  # twice is fine


def test_tied_weights_with_conflicting_values_are_refused():
    model = tiny_hf_model("llama", tie_word_embeddings=True)
    c = RolloutClient.local(model, num_pages=32)
    before = c.generate([[1, 2, 3]], SEEDED)[0].token_ids
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    assert "lm_head.weight" in sd and "model.embed_tokens.weight" in sd
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"] + 1
    with pytest.raises(ValueError, match="'model.embed_tokens.weight' and 'lm_head.weight' are tied"):
        c.update_weights(sd, 1)
    assert c.engine.policy_version == 0 and c.generate([[1, 2, 3]], SEEDED)[0].token_ids == before
    # the same values under both names (a tied model's own state dict, or copies) are fine
    c.update_weights(dict(model.state_dict()), 1)
    c.update_weights({k: v.clone() for k, v in model.state_dict().items()}, 2)
    assert c.generate([[1, 2, 3]], SEEDED)[0].token_ids == before


def test_version_beyond_int32_refused_and_the_largest_one_serialises(llama):
    c = RolloutClient.local(llama, num_pages=32)
    for bad in (2**31, 2**63, True, 1.0):
        with pytest.raises(ValueError, match="version"):
            c.update_weights(dict(llama.state_dict()), bad)
    c.update_weights(dict(llama.state_dict()), 2**31 - 1)
    r = c.generate([[1, 2, 3]], SEEDED)[0]
    assert RolloutResult.from_msgpack(r.to_msgpack()).token_versions == [2**31 - 1] * len(r.token_ids)


# ---- item 12: text that is not valid Unicode, and tokenizer errors --------------------------------------
@pytest.mark.parametrize("make,field", [
    (lambda: RolloutRequest("\ud800\udfff"), "RolloutRequest.prompt"),
    (lambda: RolloutRequest([{"role": "user", "content": "a\udc80"}]), r"RolloutRequest.prompt\[0\]\['content'\]"),
    (lambda: RolloutRequest("hi", request_id="\ud800"), "RolloutRequest.request_id"),
    (lambda: SamplingParams(stop=["ok", "\ud800"]), r"SamplingParams.stop\[1\]"),
])
def test_text_that_is_not_unicode_is_refused(make, field):
    with pytest.raises(ValueError, match=f"{field}: not valid Unicode"):
        make()


def _word_tokenizer():
    """A real transformers tokenizer (a word-level vocabulary built in memory) whose chat template refuses
    anything but user messages, as many templates refuse roles they do not know."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["<eos>", "<unk>", "hi", "there", "user", "assistant", ":"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    template = ("{% for m in messages %}{% if m['role'] != 'user' %}{{ raise_exception('only user messages') }}"
                "{% endif %}user : {{ m['content'] }} {% endfor %}assistant :")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>", chat_template=template)


def test_tokenizer_errors_become_value_errors_naming_the_request(llama):
    c = RolloutClient.local(llama, tokenizer=_word_tokenizer(), num_pages=32)
    bad = RolloutRequest([{"role": "system", "content": "hi"}], SEEDED, request_id="sys-1")
    with pytest.raises(ValueError, match="request 'sys-1': the tokenizer rejected the prompt .*only user messages"):
        c.generate([RolloutRequest("hi there", SEEDED), bad])
    assert not c.engine.has_unfinished()
    assert c.generate(["hi there"], SEEDED)[0].finish_reason == "length"
