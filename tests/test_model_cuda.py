"""DecoderLM on a CUDA device: torch backend vs HF, decode replayed in a CUDA graph, cuda vs torch backend."""
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from rollout_service.model import load_model
from rollout_service.ops import select_ops
from rollout_service.ops.attention import make_metadata
from test_model import ARCHS, PagedRunner, hf_logits, tiny_hf_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def prefill_then_decode(runner, ids, prefix):
    logits = [runner.step({0: ids[:prefix]})[0]]
    for t in ids[prefix:]:
        logits.append(runner.step({0: [t]}, is_prefill=False)[0])
    return torch.cat(logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_torch_backend_on_cuda_matches_hf(arch):
    hf = tiny_hf_model(arch).cuda()
    ids = torch.randint(0, 256, (19,), generator=torch.Generator().manual_seed(5)).tolist()
    ref = hf_logits(hf, ids)
    model = load_model(hf, dtype=torch.float32, device="cuda").model
    assert (prefill_then_decode(PagedRunner(model), ids, 7) - ref).abs().max() < 2e-4
    hf16 = tiny_hf_model(arch).to("cuda", torch.bfloat16)
    model16 = load_model(hf16, device="cuda").model  # bfloat16 is the CUDA default
    assert model16.lm_head.weight.dtype == torch.bfloat16
    got16 = prefill_then_decode(PagedRunner(model16), ids, 7)
    assert (got16 - ref).abs().max() < 0.1 and (got16 - hf_logits(hf16, ids)).abs().max() < 0.1


def test_torch_decode_step_replays_in_a_cuda_graph():
    model = load_model(tiny_hf_model("qwen3").cuda(), dtype=torch.float32, device="cuda").model
    runner = PagedRunner(model)
    gen = torch.Generator().manual_seed(6)
    prompts = {s: torch.randint(0, 256, (n,), generator=gen).tolist() for s, n in enumerate([5, 9, 2])}
    runner.step(prompts)

    def decode_inputs(tokens):  # same shapes every step: page counts stay 2, 3, 1
        for s in prompts:
            runner.lens[s] += 1
        tables = [runner.pages[s] for s in prompts]
        meta = make_metadata(tables, [1, 1, 1], [runner.lens[s] for s in prompts], 4, False, "cuda")
        return torch.tensor(tokens, device="cuda"), meta

    ids, meta = decode_inputs([1, 2, 3])
    eager_kv = [kv.clone() for kv in runner.kv]
    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up off the capture stream (rewrites the same K/V slots)
            model(ids, meta.positions, runner.kv, meta)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(ids, meta.positions, runner.kv, meta)
        for tokens in ([1, 2, 3], [7, 8, 9]):
            if tokens[0] != 1:  # the next step: new inputs copied into the captured buffers
                new_ids, new_meta = decode_inputs(tokens)
                ids.copy_(new_ids)
                for name in ("slot_mapping", "positions", "kv_lens", "block_tables", "kv_last_page_len"):
                    getattr(meta, name).copy_(getattr(new_meta, name))
            graph.replay()
            expected = model(ids.clone(), meta.positions.clone(), eager_kv, meta)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        for a, b in zip(runner.kv, eager_kv):
            assert torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def test_cuda_backend_agrees_with_torch_backend():
    try:
        select_ops("cuda")
    except (ValueError, RuntimeError) as exc:
        pytest.skip(f"cuda backend unavailable: {exc}")
    torch.manual_seed(0)  # head_dim 64 and page_size 16: shapes the kernels cover
    config = Qwen2Config(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    hf = AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(7)).tolist()
    outs = {}
    for backend in ("torch", "cuda"):
        model = load_model(hf, device="cuda", backend=backend).model
        assert model.ops.name == backend
        outs[backend] = prefill_then_decode(PagedRunner(model, num_pages=16, page_size=16), ids, 20)
    ref = hf_logits(hf, ids)
    assert (outs["cuda"] - outs["torch"]).abs().max() < 5e-2
    assert (outs["cuda"] - ref).abs().max() < 5e-2
