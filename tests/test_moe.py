"""Mixture-of-experts models (Qwen3-MoE, Mixtral) in DecoderLM against HF transformers on the same weights and
tokens, the MoE config fields honoured or refused, and the MoE ops' semantics (ops/moe_experts.py)."""
import pytest
import torch
import torch.nn.functional as F
from test_model import PagedRunner, hf_logits
from tiny_models import tiny_hf_model

from rollout_service.model import DecoderLM, load_model, moe_spec
from rollout_service.model.moe import SparseMoeBlock, check_moe_backend
from rollout_service.ops import cuda_moe, moe_experts
from rollout_service.ops.invariant import InvariantOps

# name -> (model_type, config overrides, the decoder layers transformers makes sparse)
CONFIGS = {
    "qwen3_moe": ("qwen3_moe", {}, (0, 1)),
    "qwen3_moe-norm_topk_prob": ("qwen3_moe", dict(norm_topk_prob=True), (0, 1)),
    # layers 1, 3, 5 by the step; 3 made dense by mlp_only_layers
    "qwen3_moe-sparse_step": ("qwen3_moe", dict(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]),
                              (1, 5)),
    "mixtral": ("mixtral", {}, (0, 1)),
    "mixtral-top3": ("mixtral", dict(num_experts_per_tok=3), (0, 1)),
}


def moe_model(name: str, seed: int = 0):
    model_type, overrides, _ = CONFIGS[name]
    return tiny_hf_model(model_type, seed=seed, **overrides)


def ours(hf) -> DecoderLM:
    model = DecoderLM(hf.config).eval()
    model.load_state_dict(hf.state_dict())
    return model


@pytest.mark.parametrize("name", CONFIGS)
def test_layers_are_sparse_where_transformers_makes_them_so(name):
    hf = moe_model(name)
    model = ours(hf)
    sparse = CONFIGS[name][2]
    assert tuple(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")) == sparse
    assert tuple(i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoeBlock)) == sparse
    assert set(dict(model.named_parameters())) == set(hf.state_dict())


@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_then_ragged_decode_matches_hf(name):
    hf = moe_model(name)
    gen = torch.Generator().manual_seed(2)
    seqs = {s: torch.randint(0, 256, (n,), generator=gen).tolist() for s, n in enumerate([19, 6, 33])}
    runner = PagedRunner(ours(hf))
    out = runner.step({s: ids[:-4] for s, ids in seqs.items()})  # a ragged prefill of three prompts
    got = {s: [out[s]] for s in seqs}
    for back in (4, 3, 2, 1):  # then one token each per step, batched
        out = runner.step({s: [ids[-back]] for s, ids in seqs.items()}, is_prefill=False)
        for s in seqs:
            got[s].append(out[s])
    for s, ids in seqs.items():
        assert (torch.cat(got[s]) - hf_logits(hf, ids)).abs().max() < 1e-4, f"{name}: sequence {s}"


@pytest.mark.parametrize("name", ["qwen3_moe-sparse_step", "mixtral"])
def test_load_from_a_saved_hf_folder_with_per_expert_names(name, tmp_path):
    """save_pretrained writes each expert's projections under their own names (Mixtral's as
    block_sparse_moe.experts.E.w1/w2/w3): the loader puts them into the stacked tensors."""
    hf = moe_model(name)
    hf.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path)).model
    live = load_model(hf).model
    assert all(torch.equal(a, b) for a, b in zip(loaded.parameters(), live.parameters()))
    ids = list(range(7, 40))
    assert (PagedRunner(loaded).step({0: ids})[0] - hf_logits(hf, ids)).abs().max() < 1e-4


def test_a_qwen3_moe_config_without_experts_is_the_dense_model_transformers_makes():
    hf = tiny_hf_model("qwen3_moe", num_experts=0)
    model = ours(hf)
    assert model.moe is None and model.moe_layers() == []
    ids = list(range(3, 30))
    assert (PagedRunner(model).step({0: ids})[0] - hf_logits(hf, ids)).abs().max() < 1e-4


def test_moe_layers_know_their_place_and_the_model_its_routing_spec():
    model = ours(moe_model("qwen3_moe-sparse_step"))
    blocks = model.moe_layers()
    assert [b.moe_index for b in blocks] == [0, 1] and model.num_moe_layers == 2
    assert blocks[1] is model.model.layers[5].mlp
    assert (model.moe.top_k, model.moe.num_experts, model.moe.sparse_layers) == (2, 4, (1, 5))
    x = torch.randn(5, 64)
    ids, weights = blocks[0].route(x)
    assert ids.shape == weights.shape == (5, 2) and ids.dtype == torch.int32 and weights.dtype == torch.float32
    dense = ours(tiny_hf_model("llama"))
    assert dense.moe is None and dense.num_moe_layers == 0 and dense.cuda_graph_blocker() is None


@pytest.mark.parametrize("overrides,message", [
    (dict(shared_expert_intermediate_size=16), "shared experts.*shared_expert_intermediate_size=16"),
    (dict(num_experts_per_tok=5), r"num_experts_per_tok=5 must be an int in \[1, 4\]"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step=0 must be an int >= 1"),
    (dict(norm_topk_prob="yes"), "norm_topk_prob='yes' must be a bool"),
    (dict(mlp_only_layers=["1"]), "mlp_only_layers"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size=0"),
    (dict(use_sliding_window=True, sliding_window=64), "sliding-window"),
    (dict(hidden_act="gelu"), "hidden_act"),
])
def test_qwen3_moe_config_fields_that_cannot_be_honoured_are_refused(overrides, message):
    config = tiny_hf_model("qwen3_moe").config
    for field, value in overrides.items():  # past transformers' own type checks: configs from elsewhere have none
        config.__dict__[field] = value
    if "sliding_window" in overrides:  # Qwen3MoeConfig keeps the window only when use_sliding_window is set
        config.sliding_window = overrides["sliding_window"]
    with pytest.raises(ValueError, match=message):
        DecoderLM(config)


def test_mixtral_config_fields_that_cannot_be_honoured_are_refused():
    config = tiny_hf_model("mixtral").config
    config.sliding_window = 32
    with pytest.raises(ValueError, match="mixtral: sliding-window"):
        DecoderLM(config)
    config.sliding_window, config.num_local_experts = None, 0
    with pytest.raises(ValueError, match="num_local_experts=0"):
        DecoderLM(config)


def test_training_only_router_fields_change_nothing():
    hf = tiny_hf_model("mixtral", router_jitter_noise=0.5, router_aux_loss_coef=0.3, output_router_logits=True)
    ids = list(range(3, 30))
    assert (PagedRunner(ours(hf)).step({0: ids})[0] - hf_logits(hf, ids)).abs().max() < 1e-4


def test_cuda_batch_invariant_on_moe_needs_bf16_and_a_hopper_gpu():
    config = tiny_hf_model("qwen3_moe").config
    spec = moe_spec(config)
    with pytest.raises(ValueError, match="batch_invariant on the cuda backend does not cover .*dtype float16"):
        check_moe_backend(spec, config, "cuda", True, torch.float16, "cuda")
    with pytest.raises(ValueError, match="torch._grouped_mm needs a CUDA GPU"):
        check_moe_backend(spec, config, "cuda", True, torch.bfloat16, "cpu")
    check_moe_backend(spec, config, "cuda", batch_invariant=False)
    check_moe_backend(spec, config, "torch", batch_invariant=True)
    check_moe_backend(None, config, "cuda", batch_invariant=True)


def test_the_cuda_moe_kernels_name_the_sizes_they_cannot_take():
    assert cuda_moe.shape_blocker(2048, 768, 128, 8) is None
    assert "multiples of 8" in cuda_moe.shape_blocker(100, 768, 128, 8)
    assert "1024 experts" in cuda_moe.shape_blocker(2048, 768, 1024, 8)
    assert "top-k 17" in cuda_moe.shape_blocker(2048, 768, 128, 17)
    assert "bfloat16" in cuda_moe.graph_blocker(torch.float16, "cuda")


def test_moe_models_skip_cuda_graphs_while_their_ops_sync_to_the_host():
    model = ours(moe_model("mixtral"))
    assert "CUDA graph" in model.cuda_graph_blocker()
    model.ops.moe_graph_blocker = lambda dtype, device: None  # a backend whose MoE ops stay on the device
    assert model.cuda_graph_blocker() is None


# ---- the ops ------------------------------------------------------------------------------------------

def per_token_reference(x, ids, weights, gate_up, down):
    """Each token's experts one at a time, in float64: what moe_experts.experts computes, without grouping."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            gate, up = (gate_up[e].double() @ x[t].double()).chunk(2)
            out[t] += weights[t, s].double() * (down[e].double() @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("ops", [None, InvariantOps()], ids=["torch", "invariant"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_and_experts_follow_the_contract(ops, renormalize):
    g = torch.Generator().manual_seed(0)
    x, router = torch.randn(37, 24, generator=g), torch.randn(6, 24, generator=g)
    gate_up, down = torch.randn(6, 20, 24, generator=g), torch.randn(6, 24, 10, generator=g)
    route = ops.moe_route if ops else moe_experts.route
    ids, weights = route(x, router, 3, renormalize)
    probs = torch.softmax(x @ router.T, -1)
    top = probs.topk(3, -1)
    assert torch.equal(ids.long(), top.indices)
    want = top.values / top.values.sum(-1, keepdim=True) if renormalize else top.values
    torch.testing.assert_close(weights, want)
    torch.testing.assert_close(moe_experts.route_weights(x, router, ids, renormalize), weights)
    experts = ops.moe_experts if ops else moe_experts.experts
    got = experts(x, ids, weights, gate_up, down)
    torch.testing.assert_close(got.double(), per_token_reference(x, ids, weights, gate_up, down), rtol=1e-5, atol=1e-4)
    assert experts(x[:0], ids[:0], weights[:0], gate_up, down).shape == (0, 24)  # a step without rows


def test_invariant_experts_give_a_row_the_same_bits_whatever_its_batch():
    g = torch.Generator().manual_seed(1)
    x, router = torch.randn(50, 64, generator=g), torch.randn(4, 64, generator=g)
    gate_up, down = torch.randn(4, 64, 64, generator=g), torch.randn(4, 64, 32, generator=g)
    ops = InvariantOps()
    ids, weights = ops.moe_route(x, router, 2, True)
    batch = ops.moe_experts(x, ids, weights, gate_up, down)
    for rows in (slice(0, 1), slice(3, 5), slice(10, 47)):
        alone_ids, alone_weights = ops.moe_route(x[rows], router, 2, True)
        assert torch.equal(alone_ids, ids[rows]) and torch.equal(alone_weights, weights[rows])
        assert torch.equal(ops.moe_experts(x[rows], alone_ids, alone_weights, gate_up, down), batch[rows])
