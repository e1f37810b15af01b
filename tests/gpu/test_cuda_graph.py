"""Decode CUDA graphs: replay == eager forward on a small random model (exact bucket and padded batch)."""
import pytest
import torch
from kv_utils import rel_err, requires_cuda
from model_utils import Pages, load, random_caches, tiny_hf_model

from rollout_service.engine.cuda_graph import CudaGraphRunner, batch_buckets
from rollout_service.engine.decode_inputs import DecodeInputs

pytestmark = pytest.mark.skipif(**requires_cuda)
MAX_BATCH, MAX_PAGES = 8, 8


def test_buckets():
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert batch_buckets(3) == [1, 2, 3]


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_graph_replay_matches_eager(model_type):
    model = load(tiny_hf_model(model_type), "cuda")
    caches = random_caches(model, 1 + MAX_BATCH * MAX_PAGES)
    inputs = DecodeInputs(MAX_BATCH, MAX_PAGES, 16, "cuda")

    def forward(ids, meta):
        return model(ids, meta.positions, caches, meta)

    runner = CudaGraphRunner(forward, inputs, MAX_BATCH)
    runner.capture()
    assert not runner.disabled and sorted(runner.graphs) == [1, 2, 4, 8]

    pages = Pages(MAX_PAGES)
    prompt_lens = [5, 16, 17, 40]
    prefill = pages.meta(list(range(4)), prompt_lens, prompt_lens, is_prefill=True)
    ids = torch.randint(0, 512, (sum(prompt_lens),), device="cuda")
    with torch.inference_mode():
        model(ids, prefill.positions, caches, prefill)

        def step(seqs, kv_lens, rows):
            tables = [pages.table(s, n) for s, n in zip(seqs, kv_lens)]
            inputs.fill(tables, torch.randint(0, 512, (len(seqs),)).tolist(), kv_lens, rows)
            inputs.upload()
            return inputs.batch(len(seqs))

        # Batch 4 is a bucket: same kernels, same shapes, same split count -> bit-identical.
        tokens, meta = step(range(4), [n + 1 for n in prompt_lens], 4)
        eager = forward(tokens, meta).clone()
        graph = runner.run(4).clone()
        assert graph.shape == eager.shape
        torch.testing.assert_close(graph, eager, rtol=0, atol=0)
        torch.testing.assert_close(runner.run(4), graph, rtol=0, atol=0)

        # Batch 3 pads to 4: padding rows write only the scratch page; real rows match eager.
        seqs3 = [0, 2, 3]
        kv3 = [prompt_lens[s] + 2 for s in seqs3]
        page1_before = [c[1:].clone() for c in caches]
        tokens3, meta3 = step(seqs3, kv3, runner.bucket(3))
        graph3 = runner.run(3).clone()
        eager3 = forward(tokens3, meta3)
        assert graph3.shape == (3, eager3.shape[1])
        assert rel_err(graph3, eager3) < 1e-2
        # Only this step's 3 slots (+ scratch page 0) may change; eager rewrote the same values.
        for before, cache in zip(page1_before, caches):
            changed = (before != cache[1:]).flatten(1).any(1).nonzero().flatten() + 1
            assert set(changed.tolist()) <= {1 + s * MAX_PAGES + (kv3[i] - 1) // 16 for i, s in enumerate(seqs3)}

        with pytest.raises(ValueError, match="rows"):
            runner.run(1)  # the inputs hold a bucket-4 batch


def test_capture_failure_disables_runner():
    def broken(*args):
        raise RuntimeError("boom")

    runner = CudaGraphRunner(broken, DecodeInputs(2, 2, 16, "cuda"), 2)
    runner.capture()
    assert runner.disabled and not runner.can_run(1)
