"""load_format="share": the engine runs a live transformers model's own tensors (model/shared_weights.py): the same
outputs as a copy, no second copy of what already has the engine's layout, writes visible both ways, and refusals
that name what is wrong."""
import pytest
import torch
from tiny_models import tiny_hf_model

from rollout_service import RolloutClient, SamplingParams
from rollout_service.model.loader import load_model

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[3, 4, 5, 6], list(range(20, 50))]


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_shared_weights_are_the_models_tensors_and_compute_as_a_copy(arch):
    hf = tiny_hf_model(arch)
    shared = load_model(hf, dtype=torch.float32, load_format="share").model
    copied = load_model(hf, dtype=torch.float32).model
    state = hf.state_dict()
    for (name, a), (other, b) in zip(shared.named_parameters(), copied.named_parameters()):
        assert name == other and torch.equal(a, b), name
    aliased = {n for n, p in shared.named_parameters() if p.data_ptr() == state[n].data_ptr()}
    fused = {n for n in state if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight",
                                            "up_proj.weight"))}
    assert aliased == set(state) - fused  # only the fused projections are copied
    if arch == "qwen3_moe":
        assert "model.layers.0.mlp.experts.gate_up_proj" in aliased


def test_the_model_and_the_engine_see_each_others_writes():
    hf = tiny_hf_model("qwen3_moe")
    with RolloutClient.local(hf, dtype="float32", load_format="share", num_pages=64) as client:
        before = [r.token_ids for r in client.generate(PROMPTS, GREEDY)]
        with torch.no_grad():
            hf.lm_head.weight.mul_(-1.0)  # a learner's in-place step: the engine samples with it next
        flipped = [r.token_ids for r in client.generate(PROMPTS, GREEDY)]
        assert flipped != before
        client.update_weights({"model.norm.weight": torch.full_like(hf.model.norm.weight, 0.5)}, 1, partial=True)
        assert torch.equal(hf.model.norm.weight, torch.full_like(hf.model.norm.weight, 0.5))


def test_what_sharing_refuses():
    hf = tiny_hf_model("llama")
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' is float32 on cpu; the engine runs bfloat16"):
        load_model(hf, dtype=torch.bfloat16, load_format="share")
    with pytest.raises(ValueError, match="takes a live transformers model"):
        load_model("smollm2-135m", load_format="share")
    with pytest.raises(ValueError, match="load_format"):
        load_model(hf, load_format="borrow")
