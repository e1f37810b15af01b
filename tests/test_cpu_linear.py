"""ops/cpu_linear.py: oneDNN's packed-weight products on the CPU equal F.linear up to rounding, follow every
in-place change of the weight, and leave autograd and other dtypes to F.linear."""
import pytest
import torch
import torch.nn.functional as F
from numerics import assert_as_close_as_the_reference

from rollout_service.ops import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear._ONEDNN, reason="this torch build has no oneDNN linear")


def _check(x, w, b=None):
    got = cpu_linear.linear(x, w, b)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.shape == exact.shape and got.dtype == torch.float32
    assert_as_close_as_the_reference(got, F.linear(x, w, b), exact, f"x {tuple(x.shape)}")


@pytest.mark.parametrize("rows", [1, 3, 32, 100])
def test_packed_products_match_f_linear(rows):
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(96, 40, generator=gen), torch.randn(96, generator=gen)
    with torch.inference_mode():
        _check(torch.randn(rows, 40, generator=gen), w)
        _check(torch.randn(rows, 40, generator=gen), w, b)
        _check(torch.randn(2, rows, 40, generator=gen), w)
        assert cpu_linear.linear(torch.randn(0, 40), w).shape == (0, 96)


@pytest.mark.parametrize("rows", [1, 32, 300])
def test_gated_linear_is_silu_of_the_gate_times_the_up_product(rows):
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(2 * 48, 40, generator=gen) * 0.2, torch.randn(rows, 40, generator=gen)

    def reference(x, w):
        gate, up = F.linear(x, w).chunk(2, dim=-1)
        return F.silu(gate) * up

    with torch.inference_mode():
        got = cpu_linear.gated_linear(x, weight)
        assert_as_close_as_the_reference(got, reference(x, weight), reference(x.double(), weight.double()), "gated")
        weight[48:].mul_(-2.0)  # a refresh of the up rows alone
        got = cpu_linear.gated_linear(x, weight)
        assert_as_close_as_the_reference(got, reference(x, weight), reference(x.double(), weight.double()), "after")


def test_an_in_place_refresh_of_a_fused_weight_is_seen():
    # a model's q/k/v params are views of one fused weight; a refresh copies into a view, in inference mode
    fused = torch.nn.Parameter(torch.randn(64, 32), requires_grad=False)
    view, x = fused[16:48], torch.randn(5, 32)
    with torch.inference_mode():
        before = cpu_linear.linear(x, fused)
        view.copy_(torch.randn(32, 32))
        after = cpu_linear.linear(x, fused)
        _check(x, fused)
    assert torch.equal(after[:, :16], before[:, :16]) and not torch.allclose(after[:, 16:48], before[:, 16:48])


def test_re_pointed_storage_is_seen():
    param = torch.nn.Parameter(torch.randn(48, 32), requires_grad=False)
    x = torch.randn(4, 32)
    with torch.inference_mode():
        cpu_linear.linear(x, param)
    param.data = torch.randn(48, 32)  # no version bump: a new address
    with torch.inference_mode():
        _check(x, param)


def test_autograd_and_other_dtypes_keep_f_linear():
    w = torch.randn(8, 4, requires_grad=True)
    y = cpu_linear.linear(torch.randn(3, 4), w)
    y.sum().backward()
    assert w.grad is not None and w.grad.shape == w.shape
    assert not cpu_linear.applies(torch.randn(3, 4, dtype=torch.bfloat16), w.detach().bfloat16())


def test_packed_copies_go_with_their_weights():
    import gc
    x = torch.randn(2, 16)
    weights = [torch.nn.Parameter(torch.randn(8, 16), requires_grad=False) for _ in range(3)]
    with torch.inference_mode():
        for w in weights:
            cpu_linear.linear(x, w)
    ids = {id(w) for w in weights}
    assert ids <= cpu_linear._cache.keys()
    del w, weights
    gc.collect()
    assert not ids & cpu_linear._cache.keys()


def test_an_engine_packs_its_weights_and_follows_a_refresh():
    import copy

    from test_engine import GREEDY, hf_greedy, prompts
    from tiny_models import tiny_hf_model

    from rollout_service import RolloutClient

    hf = tiny_hf_model("llama")
    new = copy.deepcopy(hf)
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(1.5)
    ps = prompts(3, seed=5)
    with RolloutClient.local(hf, num_pages=64) as client:
        model = client.engine.model
        assert [r.token_ids for r in client.generate(ps, GREEDY)] == [hf_greedy(hf, p, GREEDY.max_tokens) for p in ps]
        layer = model.model.layers[0]
        packed = {id(model.lm_head.weight), id(layer.self_attn.qkv[0]), id(layer.mlp.gate_up[0])}
        assert packed <= cpu_linear._cache.keys()  # the fast path is really taken
        client.update_weights(new.state_dict(), version=1)
        after = [r.token_ids for r in client.generate(ps, GREEDY)]
    assert after == [hf_greedy(new, p, GREEDY.max_tokens) for p in ps]
