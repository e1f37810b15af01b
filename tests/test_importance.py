"""Importance weights for the rollout/learner numerics mismatch (rollout_service/training/importance.py)."""
import numpy as np
import pytest
import torch

from rollout_service.training.importance import importance_weights, ratio_report

ROLLOUT = np.log(np.array([0.5, 0.5, 0.5, 0.5, 0.5], np.float32))
LEARNER = torch.log(torch.tensor([0.5, 0.9, 0.2, 1.0, 0.26], requires_grad=True))  # ratios 1, 1.8, 0.4, 2, 0.52


def test_tis_truncates_above_the_cap_and_keeps_the_rest():
    w = importance_weights(ROLLOUT, LEARNER, "tis", cap=1.5)
    torch.testing.assert_close(w, torch.tensor([1.0, 1.5, 0.4, 1.5, 0.52]), rtol=1e-5, atol=1e-6)
    assert not w.requires_grad and w.dtype == torch.float32


def test_mis_drops_the_tokens_outside_the_band():
    w = importance_weights(ROLLOUT, LEARNER, "mis", cap=2.0)
    assert w.tolist() == [1.0, 1.0, 0.0, 1.0, 1.0]  # 0.4 < 1/2; 2.0 and 0.52 are inside


def test_on_policy_tokens_weigh_one_in_either_mode():
    same = torch.tensor(ROLLOUT)
    for mode in ("tis", "mis"):
        assert importance_weights(ROLLOUT, same, mode).tolist() == [1.0] * 5


@pytest.mark.parametrize("kw, why", [(dict(mode="ppo"), "mode='ppo'"), (dict(cap=1.0), "cap=1.0"),
                                     (dict(cap=float("inf")), "cap=inf"), (dict(cap=True), "cap=True")])
def test_bad_arguments_name_themselves(kw, why):
    with pytest.raises(ValueError, match=why.replace("(", r"\(")):
        importance_weights(ROLLOUT, LEARNER, **kw)
    with pytest.raises(ValueError, match="rollout log-probs for"):
        importance_weights(ROLLOUT[:3], LEARNER)


def test_ratio_report():
    rep = ratio_report(ROLLOUT, LEARNER.detach().numpy(), cap=1.9)
    assert rep["ratio_max"] == pytest.approx(2.0, rel=1e-5) and rep["ratio_outside_share"] == pytest.approx(3 / 5)  # 0.4, 2.0 and 0.52 < 1/1.9
    assert rep["ratio_mean"] == pytest.approx((1 + 1.8 + 0.4 + 2 + 0.52) / 5, rel=1e-5)
    assert ratio_report([], [])["ratio_max"] is None


def test_the_corrected_loss_weighs_each_tokens_gradient_by_its_importance_weight():
    """With the learner's weights the ones the engine sampled with, the gradient is -A sum_t w_t grad lp_t."""
    from rollout_service.training.loss import corrected_pg_loss
    logits = torch.tensor([[0.3, -1.0, 2.0], [1.5, 0.2, -0.4], [0.0, 0.1, 0.2]], requires_grad=True)
    tokens = torch.tensor([2, 0, 1])
    lp = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
    rollout = lp.detach() + torch.tensor([0.0, 0.9, -0.9])  # ratios 1, e^-0.9 = 0.41, e^0.9 = 2.46
    for mode, w in (("tis", [1.0, 0.4066, 2.0]), ("mis", [1.0, 0.0, 0.0])):
        logits.grad = None
        corrected_pg_loss(lp, rollout, 1.5, 0.2, mode, 2.0).backward(retain_graph=True)
        got = logits.grad.clone()
        logits.grad = None
        (-1.5 * (torch.tensor(w) * lp).sum()).backward(retain_graph=True)
        torch.testing.assert_close(got, logits.grad, rtol=1e-3, atol=1e-6)
