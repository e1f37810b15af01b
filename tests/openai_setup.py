"""Shared set-up of the OpenAI endpoint tests: a word-level chat tokenizer whose template renders tools, and a
tiny model that answers with a few words at fixed, distinct odds and never ends a turn by itself (EOS has
no mass), so that token-exactness checks compare varied log-probs and a resent history renders back to the
sampled tokens."""
from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_hf_model

from rollout_service import RolloutClient

WORDS = ["<unk>", "<eos>", "<s>", "yes", "no", "system", "user", "assistant", "tool", "tools", ":", "add", "?"]
ANSWERS = {"yes": 0.0, "no": -0.5, "1": -1.0, "2": -1.5, "3": -2.5}  # a word's log-odds against "yes"
TEMPLATE = ("{% if tools %}tools : {% for t in tools %}{{ t['function']['name'] }} {% endfor %}{% endif %}"
            "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant :{% endif %}")


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = WORDS + [str(i) for i in range(10)]
    words += [f"w{i}" for i in range(128 - len(words))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", unk_token="<unk>",
                                   chat_template=TEMPLATE)


def word_model(tok):
    """Ignores its input (blocks zeroed, embeddings alike): every position gives ANSWERS' distribution."""
    model = tiny_hf_model("llama", seed=5, vocab_size=len(tok))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.fill_(1.0)
        head = model.lm_head.weight
        head.zero_()  # every other word (EOS included) at logit 0: e**-20 against the answers
        for word, odds in ANSWERS.items():
            head[tok.convert_tokens_to_ids(word)] = (20.0 + odds) / head.shape[1]
    return model


def local_client(tok) -> RolloutClient:
    return RolloutClient.local(word_model(tok), tokenizer=tok, backend="torch", dtype="float32", device="cpu",
                               num_pages=256)


def auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


TOKEN = "test-token-0123456789abcdef"


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer()


@pytest.fixture(scope="module")
def client(tok):
    """A local client on the word model (test modules load these fixtures with pytest_plugins)."""
    with local_client(tok) as c:
        yield c
