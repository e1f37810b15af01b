"""Benchmark models: random-weight configs with real shapes, the embedded SmolLM2, a tiny smoke model.

Every model is a live transformers CausalLM; the engine and the HF peers both run that one object's
weights, so a benchmark never compares two different sets of numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3MoeConfig

from rollout_service.model.gguf_cache import pretrained_location
from rollout_service.model.loader import gguf_file

# Real shapes (benchmarks/README.md); weights are random (seeded), so no hub access is ever needed.
_RANDOM_CONFIGS = {
    "qwen2.5-0.5b": lambda: Qwen2Config(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, head_dim=64, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    ),
    "llama3-8b": lambda: LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
        max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
    ),
    # ~61 GB in bf16; every layer sparse (128 experts, 8 per token, each a 768-wide gated MLP).
    "qwen3-30b-a3b": lambda: Qwen3MoeConfig(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, vocab_size=151936, tie_word_embeddings=False, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6,
    ),
    # Smoke-test models: small enough that --quick runs in seconds on a shared CPU.
    "tiny-qwen3-moe": lambda: Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, vocab_size=512, tie_word_embeddings=False, max_position_embeddings=2048,
    ),
    "tiny-llama": lambda: LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=False,
        max_position_embeddings=2048,
    ),
}
EMBEDDED = "smollm2-135m"
MODEL_NAMES = (*_RANDOM_CONFIGS, EMBEDDED)
ALIASES = {"smollm2": EMBEDDED}  # --model names that stand for another (the results name the model as above)


@dataclass
class BenchModel:
    name: str
    hf_model: torch.nn.Module | None  # None: the config only (workloads that build the model elsewhere)
    config: PretrainedConfig
    device: torch.device
    dtype: torch.dtype
    weights: str  # "random (seed N)" or the file the weights came from

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        return int(self.config.num_key_value_heads)

    @property
    def head_dim(self) -> int:
        hd = getattr(self.config, "head_dim", None)
        return int(hd or self.config.hidden_size // self.config.num_attention_heads)

    @property
    def elem_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def decode_params(self) -> int:
        """Parameters one decode step may read: all but the input embedding table, whose rows are only
        gathered — unless it is tied, in which case it is the LM head."""
        total = self.num_params()
        if self.config.tie_word_embeddings:
            return total
        return total - int(self.config.vocab_size) * int(self.config.hidden_size)

    @property
    def moe(self):
        """The mixture-of-experts layout (model/registry.py MoeSpec), None for a dense model."""
        from rollout_service.model.registry import moe_spec
        return moe_spec(self.config)

    def expert_params(self) -> int:
        """Parameters of one expert of one layer (gate, up and down): what a token routed there reads."""
        spec = self.moe
        return 0 if spec is None else 3 * int(self.config.hidden_size) * spec.expert_intermediate_size

    def dense_decode_params(self) -> int:
        """decode_params() without the experts: what every decode step reads whatever its routing."""
        spec = self.moe
        experts = 0 if spec is None else len(spec.sparse_layers) * spec.num_experts * self.expert_params()
        return self.decode_params() - experts

    def active_params(self) -> int:
        """Parameters one token multiplies by: the dense ones and its k experts per MoE layer."""
        spec = self.moe
        routed = 0 if spec is None else len(spec.sparse_layers) * spec.top_k * self.expert_params()
        return self.dense_decode_params() + routed

    def projection_params(self) -> int:
        """The attention and MLP projections' weights of a dense model: what quantization='fp8' holds in e4m3."""
        c, h = self.config, int(self.config.hidden_size)
        attn = h * self.head_dim * 2 * (int(c.num_attention_heads) + self.num_kv_heads)
        return self.num_layers * (attn + 3 * h * int(c.intermediate_size))

    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.elem_bytes

    def num_params(self) -> int:
        if self.hf_model is not None:
            return sum(p.numel() for p in self.hf_model.parameters())
        with torch.device("meta"):  # config only: count without allocating
            return sum(p.numel() for p in AutoModelForCausalLM.from_config(self.config).parameters())

    def state_dict_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.hf_model.state_dict().values())


def default_dtype(name: str, device: torch.device) -> torch.dtype:
    # benchmarks/README.md: random models in bf16; the CPU reference run of SmolLM2 is fp32.
    if name == EMBEDDED and device.type == "cpu":
        return torch.float32
    if name in ("tiny-llama", "tiny-qwen3-moe"):
        return torch.float32
    return torch.bfloat16


def load_bench_model(name: str, device: torch.device, dtype: torch.dtype | None = None,
                     seed: int = 0, weights: bool = True) -> BenchModel:
    """weights=False: the config alone (for a random model; the embedded one's config is read from its
    converted folder)."""
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown benchmark model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    dtype = dtype or default_dtype(name, device)
    if not weights:
        return BenchModel(name, None, _config(name), device, dtype, "none in this process (config only)")
    if name == EMBEDDED:
        gguf = gguf_file(EMBEDDED)
        path, extra = pretrained_location(gguf)  # the converted copy in the model cache, when there is one
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, **extra)
        model = model.to(device)
        config, weights = model.config, f"{gguf.name} (dequantised to {dtype})"
    else:
        config = _RANDOM_CONFIGS[name]()
        torch.manual_seed(seed)
        # Build straight on the device: an 8B model initialised on the CPU would take minutes.
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
        weights = f"random (seed {seed})"
    model.eval()
    model.generation_config.pad_token_id = 0
    return BenchModel(name, model, config, device, dtype, weights)


def _config(name: str) -> PretrainedConfig:
    if name != EMBEDDED:
        return _RANDOM_CONFIGS[name]()
    from transformers import AutoConfig
    path, extra = pretrained_location(gguf_file(EMBEDDED))
    return AutoConfig.from_pretrained(path, local_files_only=True, **extra)


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Uniform random token ids; seeded so the engine and every peer see the same prompts."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n, length), generator=gen).tolist()
