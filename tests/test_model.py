"""DecoderLM vs HF transformers on tiny random configs of every supported architecture, and the loader."""
import pytest
import torch
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, MistralConfig,
                          Qwen2Config, Qwen3Config)

from rollout_service.model import DecoderLM, load_model, validate_named_tensors
from rollout_service.model.weight_update import apply_named_tensors
from rollout_service.ops.attention import make_metadata

PAGE = 4
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)


def tiny_config(arch):
    if arch == "llama":  # biases everywhere and llama3 rope scaling
        return LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
    if arch == "mistral":
        return MistralConfig(**COMMON, sliding_window=None)
    if arch == "qwen2":  # qkv bias, tied embeddings
        return Qwen2Config(**{**COMMON, "tie_word_embeddings": True})
    if arch == "qwen3":  # q/k norm, head_dim wider than hidden / heads, yarn rope
        return Qwen3Config(**COMMON, head_dim=32, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 64})
    raise AssertionError(arch)


ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


def tiny_hf_model(arch, seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch)).eval()
    with torch.no_grad():  # HF init leaves norms at 1 and biases at 0; randomise so every weight matters
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


class PagedRunner:
    """Drives a DecoderLM over a paged KV cache with shuffled pages: the engine's job, in miniature."""

    def __init__(self, model, num_pages=96, seed=0, page_size=PAGE):
        layers, kv_heads, head_dim = model.kv_cache_spec()
        weight = model.lm_head.weight
        self.model, self.device = model, weight.device
        self.kv = [torch.full((num_pages, 2, kv_heads, page_size, head_dim), float("nan"), dtype=weight.dtype,
                              device=self.device) for _ in range(layers)]
        self.free = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
        self.pages, self.lens, self.page_size = {}, {}, page_size

    @torch.inference_mode()
    def step(self, chunks, is_prefill=None):
        """chunks: {seq_id: new token ids}; returns {seq_id: float32 logits [len(new), V]}."""
        tables, q_lens, kv_lens = [], [], []
        for sid, toks in chunks.items():
            n = self.lens.get(sid, 0) + len(toks)
            pages = self.pages.setdefault(sid, [])
            while len(pages) * self.page_size < n:
                pages.append(self.free.pop())
            self.lens[sid] = n
            tables.append(list(pages))
            q_lens.append(len(toks))
            kv_lens.append(n)
        meta = make_metadata(tables, q_lens, kv_lens, self.page_size, is_prefill=is_prefill, device=self.device)
        ids = torch.tensor([t for toks in chunks.values() for t in toks], device=self.device)
        logits = self.model.compute_logits(self.model(ids, meta.positions, self.kv, meta))
        return dict(zip(chunks, logits.split(q_lens)))


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids], device=hf.device)).logits[0].float()


def ours(hf):
    model = DecoderLM(hf.config).eval()
    model.load_state_dict(hf.state_dict())
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_full_prefill_matches_hf(arch):
    hf = tiny_hf_model(arch)
    ids = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    got = PagedRunner(ours(hf)).step({0: ids})[0]
    ref = hf_logits(hf, ids)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert (got - ref).abs().max() < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_then_batched_decode_matches_hf(arch):
    hf = tiny_hf_model(arch)
    gen = torch.Generator().manual_seed(2)
    seqs = {s: torch.randint(0, 256, (n,), generator=gen).tolist() for s, n in enumerate([14, 6, 21])}
    refs = {s: hf_logits(hf, ids) for s, ids in seqs.items()}
    runner = PagedRunner(ours(hf))
    prefix = {0: 3, 1: 5, 2: 9}
    out = runner.step({s: seqs[s][:prefix[s]] for s in seqs})  # ragged prefill of three prompts
    got = {s: [out[s]] for s in seqs}
    out = runner.step({0: seqs[0][3:8], 2: seqs[2][9:12]})  # a chunk on top of a cached prefix
    got[0].append(out[0]), got[2].append(out[2])
    done = {0: 8, 1: 5, 2: 12}
    while any(done[s] < len(seqs[s]) for s in seqs):  # decode the rest, ragged, in one batch per step
        active = [s for s in seqs if done[s] < len(seqs[s])]
        out = runner.step({s: [seqs[s][done[s]]] for s in active}, is_prefill=False)
        for s in active:
            got[s].append(out[s])
            done[s] += 1
    for s in seqs:
        assert (torch.cat(got[s]) - refs[s]).abs().max() < 1e-4, f"sequence {s}"


def test_ragged_batch_equals_each_sequence_alone():
    model = ours(tiny_hf_model("qwen3"))
    gen = torch.Generator().manual_seed(3)
    seqs = {s: torch.randint(0, 256, (n,), generator=gen).tolist() for s, n in enumerate([5, 17, 9])}
    batch = PagedRunner(model, seed=1).step(seqs)
    for s, ids in seqs.items():
        alone = PagedRunner(model, seed=2).step({s: ids})[s]
        torch.testing.assert_close(batch[s], alone, atol=1e-5, rtol=1e-5)


def test_parameter_names_match_hf_and_tied_embedding_is_shared():
    hf = tiny_hf_model("qwen2")
    model = ours(hf)
    names = dict(model.named_parameters(remove_duplicate=False))
    assert set(names) == set(hf.state_dict())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.kv_cache_spec() == (2, 2, 16)
    assert ours(tiny_hf_model("qwen3")).kv_cache_spec() == (2, 2, 32)


def test_load_from_live_model_and_bfloat16():
    hf = tiny_hf_model("llama")
    loaded = load_model(hf)
    assert loaded.tokenizer is None and loaded.hf_config is hf.config
    assert next(loaded.model.parameters()).dtype == torch.float32
    ids = list(range(40, 60))
    assert (PagedRunner(loaded.model).step({0: ids})[0] - hf_logits(hf, ids)).abs().max() < 1e-4
    bf16 = load_model(hf, dtype="bfloat16", tokenizer="tok").model
    assert bf16.lm_head.weight.dtype == torch.bfloat16 and bf16.cos_sin.dtype == torch.bfloat16
    assert (PagedRunner(bf16).step({0: ids})[0] - hf_logits(hf, ids)).abs().max() < 0.1
    assert load_model(hf, tokenizer="tok").tokenizer == "tok"


def test_load_from_saved_hf_folder(tmp_path):
    hf = tiny_hf_model("qwen2")
    hf.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.tokenizer is None and loaded.hf_config.model_type == "qwen2"
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
    ids = list(range(7, 30))
    assert (PagedRunner(loaded.model).step({0: ids})[0] - hf_logits(hf, ids)).abs().max() < 1e-4


def test_unknown_source_and_unsupported_arch_raise(tmp_path):
    with pytest.raises(ValueError, match="no-such-model-xyz"):
        load_model("no-such-model-xyz")
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(ValueError, match="gpt2.*llama"):
        load_model(gpt2)
    gpt2.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="gpt2"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="sliding-window"):
        DecoderLM(MistralConfig(**COMMON, sliding_window=16))
    with pytest.raises(ValueError, match="dtype"):
        load_model(tiny_hf_model("mistral"), dtype="int8")


def test_validate_named_tensors_rejects_bad_updates_and_applies_good_ones():
    hf = tiny_hf_model("qwen2")
    model = ours(hf)
    emb = torch.randn(256, 64)
    with pytest.raises(ValueError, match="model.layers.9.mlp.up_proj.weight"):
        validate_named_tensors(model, {"model.layers.9.mlp.up_proj.weight": torch.zeros(128, 64)})
    with pytest.raises(ValueError, match=r"model.norm.weight.*\(3,\)"):
        validate_named_tensors(model, [("model.norm.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match="lm_head.weight.*floating"):
        validate_named_tensors(model, {"lm_head.weight": torch.zeros(256, 64, dtype=torch.int64)})
    pairs = validate_named_tensors(model, {"lm_head.weight": emb, "model.norm.weight": torch.ones(64)})
    apply_named_tensors(pairs)
    assert torch.equal(model.model.embed_tokens.weight, emb) and model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.norm.weight, torch.ones(64))
