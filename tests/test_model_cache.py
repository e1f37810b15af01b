"""The GGUF cache (rollout_service/model/gguf_cache.py) on a tiny GGUF file written here: converted once,
reused, keyed by content, safe with concurrent writers, optional when the cache dir is unwritable; and the
learner's load_policy reads the same folder and never a hub."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from actors.learner import load_policy
from rollout_service.model import load_model
from rollout_service.model.gguf_cache import cache_dir, read_gguf

REPO = Path(__file__).resolve().parents[1]
MESSAGES = [{"role": "user", "content": "hello world"}]


def write_tiny_gguf(path: Path, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4,
                    kv_heads: int = 2, ffn: int = 128) -> Path:
    """A random 2-layer Llama GGUF (Q8_0 matrices, F32 norms) with a byte-level BPE tokenizer and a chat
    template, as llama.cpp lays it out: ~100 KB."""
    from tokenizers.pre_tokenizers import ByteLevel

    rng = np.random.default_rng(seed)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["h e", "l l", "Ġ w"]
    tokens = specials + sorted(ByteLevel.alphabet()) + [m.replace(" ", "") for m in merges]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * len(specials)
                      + [gguf.TokenType.NORMAL] * (len(tokens) - len(specials)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

    def tensor(name: str, *shape: int) -> None:
        a = rng.normal(0.0, 0.25, size=shape).astype(np.float32)
        if len(shape) == 1:
            w.add_tensor(name, a)
        else:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(a, q8), raw_dtype=q8)

    kv = kv_heads * hidden // heads
    tensor("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        for name, shape in [("attn_norm", (hidden,)), ("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)),
                            ("attn_v", (kv, hidden)), ("attn_output", (hidden, hidden)), ("ffn_norm", (hidden,)),
                            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))]:
            tensor(f"blk.{i}.{name}.weight", *shape)
    tensor("output_norm.weight", hidden)  # no output.weight: the lm_head is tied to the embedding
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("ROLLOUT_SERVICE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf")


def entries(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "gguf").iterdir() if p.is_dir())


def config_fields(config) -> dict:
    return {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}


def assert_matches_direct_read(loaded, gguf_path: Path) -> None:
    config, state, tokenizer = read_gguf(gguf_path)
    assert config_fields(loaded.hf_config) == config_fields(config)
    for name, tensor in state.items():
        assert torch.equal(loaded.model.get_parameter(name), tensor), name
    text = "hello world, hello <|im_end|>"
    assert loaded.tokenizer(text).input_ids == tokenizer(text).input_ids
    assert (loaded.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
            == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False))


def tamper(entry: Path) -> torch.Tensor:
    """Change one weight in a cache entry; a load that shows it read the entry, not the GGUF."""
    state = load_file(entry / "model.safetensors")
    state["model.norm.weight"] = state["model.norm.weight"] + 1.0
    save_file(state, entry / "model.safetensors", metadata={"format": "pt"})
    return state["model.norm.weight"]


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("ROLLOUT_SERVICE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "rollout_service"
    monkeypatch.setenv("ROLLOUT_SERVICE_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_first_load_writes_an_entry_that_later_loads_read(cache, tiny_gguf):
    first = load_model(tiny_gguf)
    [entry] = entries(cache)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in entry.iterdir()}
    assert not list((cache / "gguf").glob(".*partial*"))
    assert_matches_direct_read(first, tiny_gguf)
    changed = tamper(entry)
    assert torch.equal(load_model(tiny_gguf).model.get_parameter("model.norm.weight"), changed)
    assert entries(cache) == [entry]


def test_a_changed_gguf_gets_a_new_entry(cache, tiny_gguf):
    load_model(tiny_gguf)
    write_tiny_gguf(tiny_gguf, seed=1)  # same path and size, other bytes
    loaded = load_model(tiny_gguf)
    assert len(entries(cache)) == 2
    assert_matches_direct_read(loaded, tiny_gguf)


def test_an_unwritable_cache_falls_back_to_the_gguf(tmp_path, monkeypatch, tiny_gguf):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("ROLLOUT_SERVICE_CACHE", str(tmp_path / "a_file" / "cache"))
    with pytest.warns(UserWarning, match="cannot write the model cache"):
        loaded = load_model(tiny_gguf)
    assert_matches_direct_read(loaded, tiny_gguf)


@pytest.mark.slow  # two fresh Python processes importing torch and transformers
def test_concurrent_conversions_leave_one_complete_entry(cache, tiny_gguf):
    code = "import sys; from rollout_service.model import load_model; load_model(sys.argv[1])"
    env = {**os.environ, "ROLLOUT_SERVICE_CACHE": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tiny_gguf)], cwd=REPO, env=env,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    assert len(entries(cache)) == 1 and not list((cache / "gguf").glob(".*partial*"))
    assert_matches_direct_read(load_model(tiny_gguf), tiny_gguf)


def test_a_partial_entry_left_by_a_killed_conversion_is_removed(cache, tiny_gguf):
    load_model(tiny_gguf)
    [entry] = entries(cache)
    stale = cache / "gguf" / f".{entry.name}.partial-killed"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half a file")
    shutil.rmtree(entry)  # as if the first conversion had never finished
    load_model(tiny_gguf)
    assert not stale.exists() and entry.is_dir()


def test_load_policy_reads_the_cached_folder(cache, tiny_gguf):
    load_model(tiny_gguf)
    [entry] = entries(cache)
    changed = tamper(entry)
    policy = load_policy(str(tiny_gguf))
    assert torch.equal(policy.get_parameter("model.norm.weight"), changed)
    assert policy.lm_head.weight is policy.model.embed_tokens.weight


def test_load_policy_refuses_a_hub_id_without_trying_the_network():
    # HF_HUB_OFFLINE would mask a download attempt, so the child process runs without it.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    code = "from actors.learner import load_policy; load_policy('someorg/somemodel')"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0
    assert "ValueError: unknown model source 'someorg/somemodel'" in out.stderr, out.stderr[-2000:]


def test_the_compiled_kernels_follow_the_service_cache(monkeypatch, tmp_path):
    from rollout_service.ops._ext import cache_root
    monkeypatch.delenv("ROLLOUT_KERNELS_CACHE", raising=False)
    monkeypatch.setenv("ROLLOUT_SERVICE_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine" / "kernels"  # the CPU kernels' too (ops/cpu_ext.py)
    monkeypatch.setenv("ROLLOUT_KERNELS_CACHE", str(tmp_path / "k"))
    assert cache_root() == tmp_path / "k"
