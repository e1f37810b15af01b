"""Which kernel moves the log-probs, and how far any bf16 implementation must move them.

1. Kernel level: the share of attention outputs that differ from the float64 result rounded to bf16, for the
   kernels and for the float32 torch reference.
2. Engine level (the small random model of tests/gpu/test_engine_gpu.py): the engine on "cuda" with one kernel
   family at a time sent back to the torch reference, each against the all-torch engine.
3. The floor: the torch engine with attention computed in float64 (exactly rounded outputs) against the float32
   torch engine. Two implementations that are both as exact as bf16 outputs allow differ by this much; a
   kernel can only beat it by reproducing the float32 reference's summation order bit for bit.
4. A peer: HF transformers in bf16 (SDPA) on the same tokens, teacher-forced, against the torch engine."""
import copy
import sys
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, "tests/gpu")
from test_engine_gpu import small_model  # noqa: E402

from rollout_service.engine.engine import Engine  # noqa: E402
from rollout_service.ops.attention import paged_attention  # noqa: E402
from rollout_service.ops.cuda_ops import CudaOps  # noqa: E402
from rollout_service.ops.torch_ops import TorchOps  # noqa: E402
from rollout_service.types import RolloutRequest, SamplingParams  # noqa: E402



def kernel_level() -> None:
    """Decode/prefill kernels and the fp32 torch reference, each against the float64 result rounded to bf16:
    the share of outputs that differ from it, and the error before that rounding where it can be seen."""
    from kv_utils import random_paged_cache, reference_attention

    from rollout_service.ops.attention import make_metadata
    from rollout_service.ops.backend import select_ops

    cuda = select_ops("cuda")
    torch.manual_seed(0)
    for hq, hk, d in [(8, 2, 64), (14, 2, 64), (32, 8, 128)]:
        for kv_lens, prefill in [([1, 17, 100, 300, 1000], False), ([100, 300], True)]:
            cache, tables = random_paged_cache(kv_lens, hk, d, torch.bfloat16)
            q_lens = kv_lens if prefill else [1] * len(kv_lens)
            meta = make_metadata(tables, q_lens, kv_lens, 16, is_prefill=prefill, device="cuda")
            q = torch.randn(sum(q_lens), hq, d, dtype=torch.bfloat16, device="cuda")
            scale = d ** -0.5
            exact = reference_attention(q, cache, tables, q_lens, kv_lens, scale)  # float64
            rounded = exact.to(torch.bfloat16)
            kern = cuda.attention(q, cache, meta, scale)
            ref32 = paged_attention(q, cache, meta, scale)
            rel = lambda o: ((o.double() - exact).abs() / exact.abs().clamp_min(1e-3)).mean().item()  # noqa: E731
            flips = lambda o: (o != rounded).float().mean().item()  # noqa: E731
            print(f"{'prefill' if prefill else 'decode '} {hq}/{hk}x{d}: differs from round(fp64): kernel "
                  f"{flips(kern):.3f}, torch fp32 ref {flips(ref32):.3f}"
                  f"; mean rel err kernel {rel(kern):.2e} ref {rel(ref32):.2e} round(fp64) {rel(rounded):.2e}",
                  flush=True)


kernel_level()

BASE = small_model()
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(0, 2048, (n,), generator=g).tolist() for n in (5, 17, 31, 64, 65, 100, 129, 200)]
originals = {k: getattr(CudaOps, k) for k in ("attention", "rms_norm", "add_rms_norm", "rope", "rope_and_write_kv")}
torch_attention = TorchOps.attention


def run(backend, model):
    eng = Engine(model_source=model, backend=backend, device="cuda", dtype="bfloat16", num_pages=1024,
                 enable_cuda_graphs=False, max_num_seqs=16)
    sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, logprobs_mode="raw")
    for i, p in enumerate(prompts):
        eng.add_request(RolloutRequest(prompt=p, sampling=sp, request_id=str(i)))
    return sorted(eng.run_until_done(), key=lambda r: int(r.request_id))


def gap(a, b):
    d = []
    for x, y in zip(a, b):
        n = next((i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t), len(x.token_ids))
        d.append(np.abs(np.asarray(x.logprobs[:n]) - np.asarray(y.logprobs[:n])))
    d = np.concatenate(d)
    return (f"mean {d.mean():.2e} median {np.median(d):.2e} p99 {np.quantile(d, 0.99):.2e} max {d.max():.2e} "
            f"(n={d.size})")


def f64_attention(self, q, kv, meta, scale):
    return paged_attention(q, kv, meta, scale, compute_dtype=torch.float64)


def run_exact(model):
    TorchOps.attention = f64_attention
    try:
        return run("torch", model)
    finally:
        TorchOps.attention = torch_attention


@torch.no_grad()
def hf_logprobs(model, results):
    """HF bf16 (SDPA) teacher-forced over prompt + generated tokens: the log-prob of each generated token."""
    hf = copy.deepcopy(model).to("cuda", torch.bfloat16)
    hf.config._attn_implementation = "sdpa"
    out = []
    for r in results:
        ids = torch.tensor([r.prompt_token_ids + r.token_ids], device="cuda")
        logits = hf(ids).logits[0].float().log_softmax(-1)
        n0 = len(r.prompt_token_ids)
        lp = logits[n0 - 1 : n0 - 1 + len(r.token_ids)].gather(1, torch.tensor(r.token_ids, device="cuda")[:, None])
        out.append(SimpleNamespace(token_ids=r.token_ids, logprobs=lp[:, 0].cpu().numpy()))
    return out


print("tf32: matmul.allow_tf32", torch.backends.cuda.matmul.allow_tf32, "precision",
      torch.get_float32_matmul_precision())
ref = run("torch", BASE)
print("torch vs torch (run to run):", gap(ref, run("torch", BASE)))


def decode_only(self, q, kv, meta, scale):
    return (torch_attention if meta.is_prefill else originals["attention"])(self, q, kv, meta, scale)


def prefill_only(self, q, kv, meta, scale):
    return (originals["attention"] if meta.is_prefill else torch_attention)(self, q, kv, meta, scale)


variants = {
    "all kernels": {},
    "attention -> torch": {"attention": torch_attention},
    "decode attention kernel only": {"attention": decode_only},
    "prefill attention kernel only": {"attention": prefill_only},
    "norms -> torch": {"rms_norm": TorchOps.rms_norm, "add_rms_norm": TorchOps.add_rms_norm},
    "rope/kv -> torch": {"rope": TorchOps.rope, "rope_and_write_kv": TorchOps.rope_and_write_kv},
}
for name, patch in variants.items():
    for k, v in originals.items():
        setattr(CudaOps, k, patch.get(k, v))
    print(f"cuda [{name}] vs torch:", gap(ref, run("cuda", BASE)), flush=True)
for k, v in originals.items():
    setattr(CudaOps, k, v)

# The floor, at the test model's LM-head sharpness (x4) and at x2 / x1: how far exact attention moves the
# float32 engine, and where the kernels and HF stand against the exact engine.
for sharp in (4.0, 2.0, 1.0):
    model = copy.deepcopy(BASE)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharp / 4.0)
    ref, exact, cuda = run("torch", model), run_exact(model), run("cuda", model)
    print(f"[lm_head x{sharp:g}] torch(f64 attention) vs torch:", gap(ref, exact))
    print(f"[lm_head x{sharp:g}] cuda vs torch:               ", gap(ref, cuda))
    print(f"[lm_head x{sharp:g}] cuda vs torch(f64 attention):  ", gap(exact, cuda))
    print(f"[lm_head x{sharp:g}] HF bf16 sdpa vs torch:       ", gap(ref, hf_logprobs(model, ref)), flush=True)
