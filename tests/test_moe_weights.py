"""Weight refresh of mixture-of-experts models: the stacked names transformers (>= 5) uses, the per-expert names
of checkpoints and older learners (Qwen3-MoE's mlp.experts.E.gate_proj, Mixtral's block_sparse_moe.experts.E.w1),
or a mix; the data checks and the manifest checks resolve names the same way."""
import pytest
import torch
from tiny_models import tiny_hf_model

from rollout_service.engine.engine import Engine
from rollout_service.model.weight_update import validate_manifest
from rollout_service.weights.buckets import plan

LAYER1 = "model.layers.1.mlp.experts"


def per_expert(state: dict, mixtral_names: bool = False, layers=(0, 1)) -> dict:
    """`state` with the stacked expert tensors of `layers` split into one tensor per expert and projection."""
    out = {}
    for name, t in state.items():
        layer = name.split(".mlp.experts.")[0]
        if ".mlp.experts." not in name or int(layer.split(".")[2]) not in layers:
            out[name] = t
            continue
        for e in range(t.shape[0]):
            if name.endswith("gate_up_proj"):
                gate, up = t[e].chunk(2)
                out[expert_name(layer, e, "gate", mixtral_names)] = gate.clone()
                out[expert_name(layer, e, "up", mixtral_names)] = up.clone()
            else:
                out[expert_name(layer, e, "down", mixtral_names)] = t[e].clone()
    if mixtral_names:  # the router too, under its old name
        out = {n.replace(".mlp.gate.", ".block_sparse_moe.gate."): t for n, t in out.items()}
    return out


def expert_name(layer: str, e: int, role: str, mixtral_names: bool) -> str:
    if mixtral_names:
        return f"{layer}.block_sparse_moe.experts.{e}.w{ {'gate': 1, 'down': 2, 'up': 3}[role]}.weight"
    return f"{layer}.mlp.experts.{e}.{role}_proj.weight"


@pytest.fixture(scope="module")
def engines():
    """An engine on one tiny Mixtral, and a reference engine loaded straight from another's weights."""
    def engine(source):
        return Engine(model_source=source, device="cpu", num_pages=32, enable_cuda_graphs=False)
    new = tiny_hf_model("mixtral", seed=7)
    return engine(tiny_hf_model("mixtral", seed=6)), new.state_dict(), engine(new).weights_digest()


@pytest.mark.parametrize("form", ["stacked", "per_expert", "mixtral_names", "mixed_layers", "mixed_tensors"])
def test_every_naming_gives_the_same_weights(engines, form):
    eng, state, want = engines
    named = {
        "stacked": lambda: state,
        "per_expert": lambda: per_expert(state),
        "mixtral_names": lambda: per_expert(state, mixtral_names=True),
        "mixed_layers": lambda: per_expert(state, layers=(1,)),  # layer 0 stacked, layer 1 per expert
        "mixed_tensors": lambda: {n: t for n, t in per_expert(state).items() if "down_proj" not in n}
        | {n: t for n, t in state.items() if n.endswith("down_proj")},  # gate/up per expert, down stacked
    }[form]()
    assert eng.weights_digest() != want
    eng.validate_manifest(plan(list(named.items())))
    eng.update_weights(named, version=eng.policy_version + 1)
    assert eng.weights_digest() == want
    eng.update_weights(tiny_hf_model("mixtral", seed=6).state_dict(), version=eng.policy_version + 1)  # back


def check_both(eng: Engine, named: dict, match: str, partial: bool = False) -> None:
    """The refresh and its manifest are refused alike, and the weights are left as they were."""
    before = eng.weights_digest()
    with pytest.raises(ValueError, match=match):
        eng.update_weights(named, version=eng.policy_version + 1, partial=partial)
    with pytest.raises(ValueError, match=match):
        validate_manifest(eng.model, plan(list(named.items())).entries, partial)
    assert eng.weights_digest() == before


def test_a_missing_expert_is_named(engines):
    eng, state, _ = engines
    named = per_expert(state)
    del named[f"{LAYER1}.3.up_proj.weight"]
    check_both(eng, named, r"1 weight\(s\) missing, e.g. \['model.layers.1.mlp.experts.3.up_proj.weight'\]")
    del named["model.layers.0.mlp.gate.weight"]
    check_both(eng, named, r"2 weight\(s\) missing, e.g. \['model.layers.0.mlp.gate.weight', "
                           r"'model.layers.1.mlp.experts.3.up_proj.weight'\]")


def test_a_stacked_tensor_left_out_is_named(engines):
    eng, state, _ = engines
    named = {n: t for n, t in state.items() if n != f"{LAYER1}.down_proj"}
    check_both(eng, named, r"missing, e.g. \['model.layers.1.mlp.experts.down_proj'\]")


@pytest.mark.parametrize("name,shape,match", [
    (f"{LAYER1}.2.gate_proj.weight", (32, 63), r"2.gate_proj.weight' has shape \(32, 63\), expected \(32, 64\)"),
    (f"{LAYER1}.2.down_proj.weight", (32, 64), r"has shape \(32, 64\), expected \(64, 32\)"),
    (f"{LAYER1}.gate_up_proj", (4, 32, 64), r"gate_up_proj' has shape \(4, 32, 64\), expected \(4, 64, 64\)"),
    (f"{LAYER1}.4.up_proj.weight", (32, 64), "unknown weight name.*experts.4.up_proj.weight.*has 4 experts"),
    ("model.layers.2.mlp.experts.0.up_proj.weight", (32, 64), "unknown weight name"),
    ("model.layers.1.block_sparse_moe.experts.0.w4.weight", (32, 64), "unknown weight name"),
])
def test_wrong_shapes_and_unknown_experts_are_refused(engines, name, shape, match):
    eng, _, _ = engines
    check_both(eng, {name: torch.zeros(shape)}, match, partial=True)


def test_a_stacked_tensor_and_its_parts_together_are_refused(engines):
    eng, state, _ = engines
    named = {f"{LAYER1}.gate_up_proj": state[f"{LAYER1}.gate_up_proj"],
             f"{LAYER1}.1.gate_proj.weight": state[f"{LAYER1}.gate_up_proj"][1, :32]}
    check_both(eng, named, "both set the same expert weights", partial=True)
    # two names of one expert's projection: like tied weights, equal values only (the data's check, not the
    # manifest's: a manifest has no values)
    aliases = {f"{LAYER1}.1.gate_proj.weight": torch.zeros(32, 64),
               "model.layers.1.block_sparse_moe.experts.1.w1.weight": torch.ones(32, 64)}
    with pytest.raises(ValueError, match="name the same expert weights but were given different values"):
        eng.update_weights(aliases, version=eng.policy_version + 1, partial=True)


def test_a_partial_refresh_of_some_experts_changes_only_them(engines):
    eng, state, _ = engines
    gate_up = eng.model.model.layers[1].mlp.experts.gate_up_proj
    before = gate_up.detach().clone()
    new_up = torch.randn(32, 64)
    eng.update_weights({f"{LAYER1}.2.up_proj.weight": new_up}, version=eng.policy_version + 1, partial=True)
    assert torch.equal(gate_up[2, 32:], new_up)
    changed = (gate_up != before).any(dim=-1)
    assert changed[2, 32:].all() and changed.sum() == 32, "only expert 2's up rows may change"
    eng.update_weights(tiny_hf_model("mixtral", seed=6).state_dict(), version=eng.policy_version + 1)  # back


def test_a_qwen3_moe_engine_takes_per_expert_names_too():
    hf = tiny_hf_model("qwen3_moe", seed=3, num_hidden_layers=4, decoder_sparse_step=2)
    eng = Engine(model_source=tiny_hf_model("qwen3_moe", seed=4, num_hidden_layers=4, decoder_sparse_step=2),
                 device="cpu", num_pages=32)
    ref = Engine(model_source=hf, device="cpu", num_pages=32)
    named = per_expert(hf.state_dict(), layers=(1, 3))
    assert not any(n.endswith("gate_up_proj") for n in named) and "model.layers.0.mlp.gate_proj.weight" in named
    eng.update_weights(named, version=1)
    assert eng.weights_digest() == ref.weights_digest()
