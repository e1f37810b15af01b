"""A GGUF file converted once into a HF folder in the user's cache, so later loads skip the GGUF parse.

transformers parses a GGUF file once for the config, once for the weights and once for the tokenizer
(~25 s for the embedded 100 MB model on 2 CPU cores, each parse mostly spent on the vocabulary's strings);
the converted folder (config.json, fp32 model.safetensors, tokenizer files) is read in ~0.3 s, in every
process: the demo, each Ray worker and its restarts, the learner.

An entry is named by the sha256 of the GGUF's bytes (0.1 s for 100 MB: cheap next to any load, and honest
where size + mtime is not) and by the transformers version that converted it. It is written into a
temporary folder and renamed into place under a file lock, so processes starting together convert once
and none ever sees half an entry. An unwritable cache is not an error: the GGUF is read directly.
"""
from __future__ import annotations

import hashlib
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from rollout_service.config import cache_dir


def converted_folder(gguf: Path) -> Path | None:
    """The cached HF folder of `gguf`, converting it on first use; None (with a warning) when the cache
    cannot be written, and the caller reads the GGUF itself."""
    from filelock import FileLock

    entry = cache_dir() / "gguf" / _entry_name(gguf)
    if entry.is_dir():
        return entry
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{entry}.lock"):
            if not entry.is_dir():  # else another process converted it while we waited
                _convert(gguf, entry)
    except OSError as e:
        warnings.warn(f"cannot write the model cache in {entry.parent} ({e}); reading {gguf.name} directly, "
                      "which is slower (set ROLLOUT_SERVICE_CACHE to a writable folder)", stacklevel=2)
        return None
    return entry


def pretrained_location(gguf: Path) -> tuple[Path, dict[str, str]]:
    """(path, extra kwargs) for a transformers from_pretrained of `gguf`: its converted folder, or the GGUF
    itself when the cache cannot be written."""
    folder = converted_folder(gguf)
    return (folder, {}) if folder is not None else (gguf.parent, {"gguf_file": gguf.name})


def read_gguf(gguf: Path) -> tuple[Any, dict[str, torch.Tensor], Any]:
    """(config, fp32 state dict, tokenizer) of a GGUF file, dequantised by transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                    local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    # The dequantised weights are plain fp32; the GGUF marker would make the config unsavable.
    vars(hf_model.config).pop("quantization_config", None)
    return hf_model.config, hf_model.state_dict(), tokenizer


def _entry_name(gguf: Path) -> str:
    import transformers

    digest = hashlib.sha256()
    with open(gguf, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    # A newer transformers may map the same GGUF to a different config or tokenizer.
    return f"{digest.hexdigest()}-transformers{transformers.__version__}"


def _convert(gguf: Path, entry: Path) -> None:
    from safetensors.torch import save_file

    for stale in entry.parent.glob(f".{entry.name}.partial-*"):  # left by a process killed mid-conversion
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.partial-", dir=entry.parent))
    try:
        config, state, tokenizer = read_gguf(gguf)
        config.save_pretrained(tmp)
        save_file(_untied(state), tmp / "model.safetensors", metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        tmp.rename(entry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses shared storage: a tied lm_head is saved once, as its embedding, and re-tied on load.
    seen: set[int] = set()
    out = {}
    for name, tensor in state.items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            out[name] = tensor.contiguous()
    return out
