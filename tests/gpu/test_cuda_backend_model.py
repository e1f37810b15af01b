"""The whole decoder on the "cuda" backend vs the "torch" backend, same weights, teacher-forced decode."""
import pytest
import torch
from kv_utils import rel_err, requires_cuda
from model_utils import Pages, load, random_caches, tiny_hf_model

pytestmark = pytest.mark.skipif(**requires_cuda)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_cuda_backend_tracks_torch_backend(model_type):
    hf = tiny_hf_model(model_type)
    ref_model, cuda_model = load(hf, "torch"), load(hf, "cuda")
    assert type(cuda_model.ops).__name__ == "CudaOps"
    ref_caches = random_caches(ref_model, 1 + 3 * 8)
    cuda_caches = [c.clone() for c in ref_caches]
    pages = Pages(8)
    prompt_lens, seqs = [7, 33, 64], [0, 1, 2]
    ids = torch.randint(0, 512, (sum(prompt_lens),), device="cuda")
    meta = pages.meta(seqs, prompt_lens, prompt_lens, is_prefill=True)
    last = torch.tensor(prompt_lens, device="cuda").cumsum(0) - 1
    errs, agree, lp_diff = [], [], []
    with torch.inference_mode():
        ref_h = ref_model(ids, meta.positions, ref_caches, meta)
        cuda_h = cuda_model(ids, meta.positions, cuda_caches, meta)
        errs.append(rel_err(cuda_h, ref_h))
        ref_logits, cuda_logits = ref_model.compute_logits(ref_h[last]), cuda_model.compute_logits(cuda_h[last])
        lens = list(prompt_lens)
        for _ in range(24):  # teacher forcing with the reference's greedy tokens
            tokens = ref_logits.argmax(-1)
            agree.append((cuda_logits.argmax(-1) == tokens).float().mean().item())
            lp_ref = ref_logits.log_softmax(-1).gather(1, tokens[:, None])
            lp_cuda = cuda_logits.log_softmax(-1).gather(1, tokens[:, None])
            lp_diff.append((lp_ref - lp_cuda).abs().mean().item())
            lens = [n + 1 for n in lens]
            step = pages.meta(seqs, [1] * 3, lens, is_prefill=False)
            ref_h = ref_model(tokens, step.positions, ref_caches, step)
            cuda_h = cuda_model(tokens, step.positions, cuda_caches, step)
            errs.append(rel_err(cuda_h, ref_h))
            ref_logits, cuda_logits = ref_model.compute_logits(ref_h), cuda_model.compute_logits(cuda_h)
    print(f"{model_type}: hidden rel err max {max(errs):.2e}; greedy agreement {sum(agree) / len(agree):.3f}; "
          f"mean |logprob diff| {sum(lp_diff) / len(lp_diff):.2e}")
    assert max(errs) < 3e-2
    assert sum(lp_diff) / len(lp_diff) < 2e-2
