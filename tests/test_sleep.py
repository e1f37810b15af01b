"""Engine sleep/wake and the in-process client's refresh rules on the CPU (the GPU side: tests/gpu)."""
import pytest
import torch
from tiny_models import tiny_hf_model

from rollout_service import RolloutClient, RolloutRequest, SamplingParams
from rollout_service.engine.engine import Engine

SEEDED = SamplingParams(n=2, temperature=0.9, max_tokens=30, ignore_eos=True, seed=11)
PROMPTS = [[5, 6, 7, 8], list(range(1, 40)), [9] * 17]


@pytest.fixture(scope="module")
def llama():
    return tiny_hf_model("llama")


def run(eng: Engine, nap=None) -> list:
    for i, p in enumerate(PROMPTS):
        eng.add_request(RolloutRequest(prompt=p, sampling=SEEDED, request_id=str(i)))
    if nap is not None:
        for _ in range(8):
            eng.step()
        nap(eng)
    return sorted((r.request_id, r.sample_index, r.token_ids) for r in eng.run_until_done())


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_mid_generation_frees_memory_and_loses_nothing(llama, level):
    want = run(Engine(model_source=llama, num_pages=256))
    eng = Engine(model_source=llama, num_pages=256)
    seen = {}

    def nap(e: Engine):
        seen["awake"] = e.stats()["device_memory_bytes"]
        e.sleep(level)
        seen["asleep"] = e.stats()
        with pytest.raises(RuntimeError, match="asleep"):
            e.step()
        e.add_request(RolloutRequest(prompt=[1, 2], sampling=SEEDED, request_id="late"))  # queued meanwhile
        if level == 2:
            with pytest.raises(ValueError, match="level=2"):
                e.wake_up()
            with pytest.raises(ValueError, match="partial=True while asleep at level 2"):
                e.update_weights({"model.norm.weight": torch.ones(64)}, 1, partial=True)
            e.update_weights(llama.state_dict(), 1)
        e.wake_up()

    got = run(eng, nap)
    kv = eng.kv.capacity_bytes()
    weights = eng.sleeper.parking.nbytes
    freed = seen["awake"] - seen["asleep"]["device_memory_bytes"]
    assert freed == (kv + weights if level == 2 else kv)
    assert seen["asleep"]["sleep_level"] == level and eng.stats()["sleep_level"] == 0
    assert eng.stats()["recomputes"] > 0 and eng.kv.blocks.num_used == 0
    assert [g for g in got if g[0] != "late"] == want  # seeded: the same tokens after the recompute
    assert len([g for g in got if g[0] == "late"]) == 2


def test_partial_refresh_while_parked_keeps_the_other_weights(llama):
    eng = Engine(model_source=llama, num_pages=64)
    before = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    eng.sleep(1)
    eng.update_weights({"model.norm.weight": torch.full((64,), 2.0)}, 1, partial=True)
    eng.wake_up()
    for n, p in eng.model.named_parameters():
        want = torch.full((64,), 2.0) if n == "model.norm.weight" else before[n]
        assert torch.equal(p, want), n


def test_local_client_refresh_rules(llama):
    with RolloutClient.local(llama, num_pages=64) as c:
        sd = llama.state_dict()
        assert c.update_weights(sd, 1, transport="cuda_ipc") == "in_process"  # in-process: a plain copy
        with pytest.raises(ValueError, match="'broadcast' needs a weight group"):
            c.update_weights(sd, 2, transport="broadcast")
        with pytest.raises(ValueError, match="transport='ipc'"):
            c.update_weights(sd, 2, transport="ipc")
        with pytest.raises(ValueError, match="no group is needed"):
            c.init_weight_group()
        with pytest.raises(ValueError, match="version=1 must be an int > the current version 1"):
            c.update_weights(sd, 1)
        bad = dict(sd)
        bad["lm_head.weight"] = sd["lm_head.weight"].clone()
        bad["lm_head.weight"][0, 0] = float("inf")
        with pytest.raises(ValueError, match="'lm_head.weight' holds NaN or inf"):
            c.update_weights(bad, 2)
        c.update_weights(bad, 2, check_finite=False)  # the learner insists
        assert c.engine.policy_version == 2
        c.sleep(1)
        with pytest.raises(RuntimeError, match="asleep \\(sleep level 1\\): call wake_up"):
            c.generate([[1, 2]], SamplingParams(max_tokens=2))
        c.wake_up()
        assert len(c.generate([[1, 2]], SamplingParams(max_tokens=2))[0].token_ids) == 2
        assert c.weights_digests() == [c.engine.weights_digest()]
