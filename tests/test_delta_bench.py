"""WD, the harness's delta-refresh workload (benchmarks/harness/delta_bench.py; its learner: delta_learner.py):
a --quick run on a tiny random model through a one-worker Ray service (the session's shared cluster), whose every
step must send fewer bytes than the same push dense and leave the worker bit for bit on a dense push's weights;
and the memory-light optimizer step its 8B run takes on a GPU, checked here on the CPU."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks.harness.delta_learner import FreshAdamSR, stochastic_bf16

pytest_plugins = ["ray_fixtures"]


def test_stochastic_rounding_goes_up_or_down_by_distance():
    gen = torch.Generator().manual_seed(0)
    lo = torch.tensor(1.0, dtype=torch.bfloat16)
    spacing = 2.0 ** -7  # between 1 and 2 bf16 values are 2^-7 apart
    x = torch.full((200_000,), 1.0 + 0.25 * spacing)  # a quarter of the way up to the next bf16 value
    r = stochastic_bf16(x, gen)
    assert set(r.unique().tolist()) == {1.0, 1.0 + spacing}
    assert (r > lo).float().mean().item() == pytest.approx(0.25, abs=0.01)
    assert r.float().mean().item() == pytest.approx(x[0].item(), abs=spacing * 0.01)  # unbiased
    neg = stochastic_bf16(-x, gen)  # negative values: the same in magnitude
    assert (neg < -lo).float().mean().item() == pytest.approx(0.25, abs=0.01)
    exact = torch.tensor([0.5, -3.0, 0.0])  # bf16 values stay as they are
    assert torch.equal(stochastic_bf16(exact, gen).float(), exact)


def test_the_memory_light_step_moves_weights_by_lr_in_the_backward():
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256, bias=False).to(torch.bfloat16)
    start = torch.tensor(0.15, dtype=torch.bfloat16).item()  # in [2^-3, 2^-2): bf16 values 2^-10 apart there
    with torch.no_grad():
        model.weight.fill_(start)
    opt = FreshAdamSR(model, lr=2.0 ** -12)  # a quarter of that spacing
    opt.zero_grad()
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    y = model(x).float()
    (y * torch.randn_like(y)).sum().backward()
    assert model.weight.grad is None  # applied and freed in the hook: no gradient kept
    moved = (model.weight.detach().float() - start) / 2.0 ** -10
    assert set(moved.unique().tolist()) <= {-1.0, 0.0, 1.0}  # to a neighbouring bf16 value or not at all
    assert opt.changed_share() == pytest.approx(0.25, abs=0.02)  # with probability |update| / spacing
    opt.close()


@pytest.mark.ray
def test_wd_sends_fewer_bytes_than_dense_and_lands_on_a_dense_pushs_weights(ray_cluster, tmp_path):
    from benchmarks.harness import main

    rc = main(["--quick", "--device", "cpu", "--model", "tiny-llama", "--workloads", "WD", "--out", str(tmp_path)])
    assert rc == 0
    (path,) = tmp_path.glob("*-wd.json")
    doc = json.loads(path.read_text())
    assert not doc["meta"].get("errors"), doc["meta"]["errors"]
    rows = {r["workload"]: r for r in doc["rows"]}
    secs, size = rows["WD delta s"], rows["WD delta bytes"]
    assert secs["engine"]["value"] > 0 and secs["other_peer"]["value"] > 0, secs["engine"]
    steps = secs["details"]["steps"]
    assert len(steps) == doc["meta"]["shapes"]["wd_steps"] == secs["details"]["steps_run"]
    for s in steps:  # every refresh after a real AdamW step went as a delta, smaller than dense
        assert s["delta"] and 0 < s["delta_bytes"] < s["dense_bytes"], s
        assert s["trained_samples"] > 0 and 0 < s["changed_share"] < 0.5, s
        assert s["digests_equal"] is True, s  # the worker's weights = an in-process engine's after a dense push
    # the chain of deltas and a dense push of the same weights on the same worker: the same digests
    assert secs["details"]["chain_equals_dense_push"] is True and secs["details"]["exact"] is True
    assert secs["details"]["learner"]["lr"] == 1e-6 and "AdamW" in secs["details"]["learner"]["optimizer"]
    assert size["engine"]["value"] < size["other_peer"]["value"] == pytest.approx(steps[0]["dense_bytes"] / 1e6)
    assert size["ratios"]["engine/other_peer"] > 1 and size["details"]["bytes_ratio_overall"] > 1
