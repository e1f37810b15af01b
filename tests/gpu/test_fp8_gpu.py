"""FP8 on the cuda backend against the reference arithmetic (ops/fp8.py): the quantization kernels bitwise (alone
and fused into the norm and SiLU·mul), the row-scaled FP8 GEMM within one rounding of the reference, the
decoder cuda vs torch, the engine with CUDA graphs, and quantize-on-refresh on the GPU."""
import pytest
import torch
from kv_utils import requires_cuda
from model_utils import Pages, load, random_caches, tiny_hf_model

from rollout_service.engine.engine import Engine
from rollout_service.ops import cuda_fp8, fp8
from rollout_service.api.types import RolloutRequest, SamplingParams

pytestmark = pytest.mark.skipif(**requires_cuda)
BF16 = torch.bfloat16


def fp8_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8 = pytest.mark.skipif(not fp8_capable(), reason="FP8 tensor cores need compute capability 8.9+")


def hostile_rows(rows: int, cols: int, dtype) -> torch.Tensor:
    """Rows of every kind the quantization meets: wide and narrow ranges, an all-zero row, e4m3-subnormal
    values, a fine ramp over the range, a NaN."""
    g = torch.Generator(device="cuda").manual_seed(rows * 7 + cols)
    x = torch.randn(rows, cols, device="cuda", generator=g) * torch.logspace(-3, 3, rows, device="cuda")[:, None]
    if rows > 3:
        x[1] = 0
        x[2] = torch.randn(cols, device="cuda", generator=g) * 1e-4
        x[2, 0] = 1.0  # the rest of the row falls into e4m3's subnormals
        x[3] = torch.arange(cols, device="cuda") % 37 * 0.53125 - 9  # a fine ramp: every e4m3 step met
    if rows > 5:
        x[5, cols // 2] = float("nan")
    return x.to(dtype)


def same_rows(a: fp8.Fp8Rows, b: fp8.Fp8Rows) -> None:
    assert torch.equal(a.q.view(torch.uint8), b.q.view(torch.uint8))
    assert torch.equal(a.scale.nan_to_num(nan=-1.0), b.scale.nan_to_num(nan=-1.0))
    assert a.dtype == b.dtype


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("rows,cols", [(1, 896), (7, 4864), (64, 8), (300, 14336)])
def test_the_quantization_kernel_is_bitwise_the_reference(cuda_ops, dtype, rows, cols):
    x = hostile_rows(rows, cols, dtype)
    same_rows(cuda_ops.fp8_quantize(x), fp8.Fp8Rows.of(x))
    assert "fp8_quantize" not in cuda_ops._fallbacks


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("rows,hidden", [(1, 896), (33, 4096), (256, 2048)])
def test_the_norm_fused_with_the_quantization_is_the_norm_then_the_quantization(cuda_ops, dtype, with_residual,
                                                                                   rows, hidden):
    x = hostile_rows(rows, hidden, dtype).nan_to_num()
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
    residual = torch.randn(rows, hidden, device="cuda").to(dtype) if with_residual else None
    res_a = None if residual is None else residual.clone()
    got, res_got = cuda_ops.rms_norm_fp8(x, res_a, weight, 1e-6)
    if residual is None:
        want, res_want = cuda_ops.fp8_quantize(cuda_ops.rms_norm(x, weight, 1e-6)), x
    else:
        y, res_want = cuda_ops.add_rms_norm(x, residual.clone(), weight, 1e-6)
        want = cuda_ops.fp8_quantize(y)
    same_rows(got, want)
    assert torch.equal(res_got, res_want)
    assert not {"rms_norm_fp8", "fp8_quantize"} & cuda_ops._fallbacks


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("rows,inter", [(1, 4864), (17, 14336), (256, 768)])
def test_silu_and_mul_fused_with_the_quantization_is_bitwise_the_reference(cuda_ops, dtype, rows, inter):
    gate_up = (torch.randn(rows, 2 * inter, device="cuda") * 3).to(dtype)
    same_rows(cuda_ops.silu_and_mul_fp8(gate_up), fp8.Fp8Rows.of(cuda_ops.silu_and_mul(gate_up)))
    assert "silu_and_mul_fp8" not in cuda_ops._fallbacks


@needs_fp8
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,k,n", [(1, 896, 1152), (1, 4096, 6144), (1, 14336, 4096), (3, 4096, 6144),
                                   (64, 4864, 896), (300, 2048, 4096), (1024, 896, 9728)])
def test_the_fp8_gemm_is_within_one_rounding_of_the_reference(cuda_ops, bias, m, k, n):
    """m = 1 runs our weight-streaming kernel, more rows torch._scaled_mm."""
    g = torch.Generator(device="cuda").manual_seed(m + k + n)
    x = torch.randn(m, k, device="cuda", generator=g).to(BF16)
    w, w_scale = fp8.quantize_rows((torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(BF16))
    b = torch.randn(n, device="cuda", generator=g).to(BF16) if bias else None
    assert cuda_fp8.probe(BF16, x.device) is not None, "no row-scaled FP8 GEMM on an FP8 GPU"
    got = cuda_ops.fp8_linear(x, w, w_scale, b)
    want = fp8.linear(x, w, w_scale, b)  # the reference: float32 products of the same e4m3 operands
    assert got.dtype == BF16 and got.shape == (m, n)
    assert "fp8_linear" not in cuda_ops._fallbacks
    # one bf16 rounding each (2^-8 relative), plus sums in another order: Hopper's FP8 tensor cores add a k-block
    # at reduced precision before cuBLAS promotes it to float32 (measured: up to ~1e-3 of the largest output where
    # outputs cancel to near zero); a separate bias add rounds twice
    err = (got.float() - want.float()).abs()
    bound = 2**-7 * want.float().abs() + 2e-3 * want.float().abs().max()
    assert bool((err <= bound).all()), float((err - bound).max())


@needs_fp8
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_the_fp8_decoder_on_cuda_tracks_the_fp8_reference(model_type):
    from rollout_service.model.loader import load_model

    hf = tiny_hf_model(model_type)
    models = [load_model(hf, dtype=BF16, device="cuda", backend=b, quantization="fp8").model for b in ("torch", "cuda")]
    ref, cuda = models
    caches = random_caches(ref, 1 + 3 * 8)
    caches = [caches, [c.clone() for c in caches]]
    pages = Pages(8)
    lens = [9, 40, 64]
    ids = torch.randint(0, 512, (sum(lens),), device="cuda")
    meta = pages.meta([0, 1, 2], lens, lens, is_prefill=True)
    last = torch.tensor(lens, device="cuda").cumsum(0) - 1
    gaps = []
    with torch.inference_mode():
        logits = [m.compute_logits(m(ids, meta.positions, c, meta)[last]) for m, c in zip(models, caches)]
        for _ in range(16):
            tokens = logits[0].argmax(-1)
            lp = [x.log_softmax(-1).gather(1, tokens[:, None]) for x in logits]
            gaps.append((lp[0] - lp[1]).abs().mean().item())
            lens = [n + 1 for n in lens]
            step = pages.meta([0, 1, 2], [1] * 3, lens, is_prefill=False)
            logits = [m.compute_logits(m(tokens, step.positions, c, step)) for m, c in zip(models, caches)]
    assert not {op for op in cuda.ops._fallbacks if "fp8" in op}, cuda.ops._fallbacks
    # An activation near an e4m3 rounding boundary may land on the other side (a 6% step) when bf16 kernels
    # upstream round differently: the gap is FP8's own error, not bf16 noise.
    assert sum(gaps) / len(gaps) < 3e-2, gaps


def _engine(model, graphs: bool, **kw) -> Engine:
    return Engine(model_source=model, device="cuda", backend="cuda", dtype="bfloat16", num_pages=256,
                  quantization="fp8", enable_cuda_graphs=graphs, max_num_seqs=8, **kw)


def _generate(engine: Engine, prompts) -> list:
    sp = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=3)
    for i, p in enumerate(prompts):
        engine.add_request(RolloutRequest(p, sp, request_id=str(i)))
    return sorted(engine.run_until_done(), key=lambda r: int(r.request_id))


@needs_fp8
def test_the_fp8_engine_replays_graphs_as_it_runs_eagerly_and_refreshes_on_the_gpu():
    a = tiny_hf_model("llama")
    prompts = [[5, 6, 7], list(range(100, 140)), [9] * 17]
    graphs, eager = _engine(a, True), _engine(a, False)
    assert graphs.runner.graphs is not None
    with_graphs, without = _generate(graphs, prompts), _generate(eager, prompts)
    assert [r.token_ids for r in with_graphs] == [r.token_ids for r in without]
    assert all((r.logprobs == s.logprobs).all() for r, s in zip(with_graphs, without))
    # a refresh quantizes on the GPU what a direct load of the same weights quantizes
    b2 = tiny_hf_model("llama")
    with torch.no_grad():
        for p in b2.parameters():
            p.mul_(1.01)
    direct = _engine(b2, True)
    graphs.update_weights({k: v.to(BF16) for k, v in b2.state_dict().items()}, 1)
    assert graphs.weights_digest() == direct.weights_digest()
    assert [r.token_ids for r in _generate(graphs, prompts)] == [r.token_ids for r in _generate(direct, prompts)]
