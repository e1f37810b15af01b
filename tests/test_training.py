"""The learner's training precision (bf16 model, fp32 master weights), its fp32 reference forward, the step
clock and the memory figures (tiny random models on the CPU; seconds)."""
from __future__ import annotations

import copy
import time

import numpy as np
import pytest
import torch

from rollout_service.training.mismatch import fp32_reference_report, token_logprobs
from rollout_service.training import LearnerOutOfMemory, MasterWeights, StepClock, memory_figures
from rollout_service.training.memory import describe, is_out_of_memory
from rollout_service.api.types import RolloutResult
from tiny_models import tiny_hf_model


def _results(n: int = 3) -> list[RolloutResult]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        prompt, tokens = rng.integers(0, 200, 4 + i).tolist(), rng.integers(0, 200, 5 + 2 * i).tolist()
        out.append(RolloutResult(request_id=f"r{i}", sample_index=0, prompt_token_ids=prompt, token_ids=tokens,
                                 logprobs=np.full(len(tokens), -5.0, np.float32), token_versions=[0] * len(tokens),
                                 finish_reason="length"))
    return out


def _loss(model, results) -> torch.Tensor:
    return -sum(lp.sum() for lp in token_logprobs(model, results))


def test_master_weights_accumulate_in_fp32_and_update_the_bf16_model():
    torch.manual_seed(0)
    fp32 = tiny_hf_model("llama")
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    mw = MasterWeights(bf16, "adamw", lr=1e-2)
    assert not mw.exact and all(m.dtype == torch.float32 for m in mw.masters)
    masters_before = [m.clone() for m in mw.masters]
    results = _results()
    for r in results:  # three micro-batches: gradients summed on the fp32 masters
        _loss(bf16, [r]).backward()
        mw.accumulate()
        assert all(p.grad is None for p in mw.params)
    whole = [m.grad.clone() for m in mw.masters]
    mw.zero_grad()
    _loss(bf16, results).backward()
    mw.accumulate()
    for a, b in zip(whole, mw.masters):  # the same sums as one batch, up to bf16 rounding of each part
        assert (a - b.grad).norm() <= 0.03 * b.grad.norm() + 1e-6
    norm = mw.step(max_grad_norm=1.0)
    assert norm > 0 and all(p.grad is None for p in mw.params) and all(m.grad is None for m in mw.masters)
    moved = [not torch.equal(a, b) for a, b in zip(masters_before, mw.masters)]
    assert all(moved)
    for p, m in zip(mw.params, mw.masters):  # the model runs the masters, rounded to bf16
        assert p.dtype == torch.bfloat16 and torch.equal(p, m.to(torch.bfloat16))
    three = sum(m.numel() * 4 * 3 for m in mw.masters)  # master + AdamW's two moments (+ a step count each)
    assert three <= mw.nbytes() <= three + 8 * len(mw.masters)


def test_an_fp32_model_is_its_own_master_and_adafactor_saves_memory():
    model = tiny_hf_model("llama")
    mw = MasterWeights(model, "adafactor", lr=1e-2)
    assert mw.exact and all(a is b for a, b in zip(mw.masters, model.parameters()))
    before = [p.clone() for p in model.parameters()]
    _loss(model, _results()).backward()
    mw.step(max_grad_norm=None)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    adam = MasterWeights(tiny_hf_model("llama"), "adamw")
    _loss(adam.model, _results()).backward()
    adam.step(1.0)
    assert mw.nbytes() < 0.2 * adam.nbytes()  # factored second moments, no first moment
    with pytest.raises(ValueError, match="optimizer='sgd'"):
        MasterWeights(model, "sgd")


def test_fp32_reference_runs_the_weights_upcast_through_the_bf16_model():
    torch.manual_seed(0)
    bf16 = tiny_hf_model("llama").to(torch.bfloat16)
    fp32 = copy.deepcopy(bf16).float()  # the same (bf16-representable) weights, run in fp32
    results = _results()
    weights = {n: p.float() for n, p in bf16.named_parameters()}
    with torch.no_grad():
        want = token_logprobs(fp32, results)
        got = token_logprobs(bf16, results, weights=weights)
        low = token_logprobs(bf16, results)
    for w, g, lo in zip(want, got, low):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)  # an fp32 forward, not a bf16 one
        assert (lo.float() - w).abs().max() > 1e-4           # which the bf16 model alone is not
    # rollout log-probs taken from the fp32 forward are exact: their error is 0, the learner's is bf16's
    exact = [RolloutResult(**{**vars(r), "logprobs": w.numpy()}) for r, w in zip(results, want)]
    rep = fp32_reference_report(bf16, exact)
    assert rep["rollout_vs_fp32"]["max_abs"] < 1e-5 < rep["learner_vs_fp32"]["mean_abs"] and rep["ratio"] < 0.1
    assert rep["rollout_vs_fp32"]["n_tokens"] == sum(len(r.token_ids) for r in results)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())  # the model itself is left as it was


def test_step_clock_splits_the_step_into_phases_and_idle():
    clock = StepClock()
    with clock.phase("rollout"):
        time.sleep(0.03)
    with clock.phase("learner"):
        time.sleep(0.02)
    time.sleep(0.01)
    row = clock.row()
    assert row["rollout_s"] >= 0.03 and row["learner_s"] >= 0.02 and row["idle_s"] >= 0.01
    assert row["sleep_s"] == row["wake_s"] == row["refresh_s"] == 0.0
    phases = sum(row[f"{p}_s"] for p in ("rollout", "reward", "learner", "refresh", "sleep", "wake", "idle"))
    assert phases == pytest.approx(row["step_s"], abs=1e-6)
    assert row["overhead_share"] == pytest.approx(row["idle_s"] / row["step_s"], abs=1e-6)
    with pytest.raises(ValueError, match="unknown step phase 'eval'"):
        with clock.phase("eval"):
            pass


def test_memory_figures_and_out_of_memory_detection_on_the_cpu():
    fig = memory_figures("cpu")
    assert fig["device"] == "cpu" and 0 < fig["rss"] <= fig["peak_rss"] * 1.5
    assert "GiB" in describe(fig)
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate "
                                         "memory: you tried to allocate 99999999999 bytes"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    import pickle  # a learner actor's error crosses processes
    err = pickle.loads(pickle.dumps(LearnerOutOfMemory("out of memory (learner allocated 1.00 GiB)", fig)))
    assert isinstance(err, LearnerOutOfMemory) and "1.00 GiB" in str(err) and err.figures == fig
