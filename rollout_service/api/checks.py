"""Input checks shared by the public types and every boundary a request crosses (client, router, engine):
text, request ids, policy versions, reward names and request metadata, each failure a ValueError naming
what is wrong.
"""
from __future__ import annotations

import pickle
import re
from collections.abc import Mapping
from typing import Any, Iterable

from rollout_service.api.values import MAX_INT32, is_int


def check_text(s: str, what: str) -> None:
    """ValueError unless `s` is Unicode text that can be encoded: a lone surrogate such as "\\ud800" is
    a valid Python str that tokenizers and msgpack reject."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what}: not valid Unicode text ({e.reason} at position {e.start})") from None


def check_policy_version(version: Any, current: int, resend: bool = False) -> None:
    """ValueError unless `version` is an int above `current` (or equal to it, for a `resend` of the same
    weights) that fits the int32 `token_versions` of the wire format: versions only go forward."""
    lowest = current if resend else current + 1
    if not is_int(version) or not lowest <= version <= MAX_INT32:
        raise ValueError(f"update_weights: version={version!r} must be an int > the current version {current} "
                         "and < 2**31")


def check_request_ids(request_ids: Any) -> list[str]:
    """abort's argument as a list of ids, or ValueError: one id must be wrapped in a list (a str would
    iterate its characters)."""
    if isinstance(request_ids, (str, bytes, Mapping)) or not isinstance(request_ids, Iterable):
        hint = " (wrap one id in a list)" if isinstance(request_ids, str) else ""
        raise ValueError(f"abort: request_ids must be a list of request id strings, got "
                         f"{type(request_ids).__name__}{hint}")
    ids = list(request_ids)
    bad = [r for r in ids if not isinstance(r, str)]
    if bad:
        raise ValueError(f"abort: request id {bad[0]!r} is a {type(bad[0]).__name__}, not a str")
    return ids


# One request's metadata, pickled: the service holds it for as long as the request is in flight (the router
# and a worker each keep a copy) and copies it onto each of the request's n results.
MAX_METADATA_BYTES = 1 << 20


class _TooBig(Exception):
    pass


class _SizeBound:
    """A file that only counts what a pickler writes to it, and stops the pickler past `limit` bytes (so an
    enormous object costs no more than the bound to refuse)."""

    def __init__(self, limit: int):
        self.size, self.limit = 0, limit

    def write(self, data: Any) -> None:
        self.size += memoryview(data).nbytes
        if self.size > self.limit:
            raise _TooBig


def check_metadata(metadata: Any, what: str = "RolloutRequest.metadata") -> None:
    """ValueError unless `metadata` pickles (as Ray sends it to the workers: the plain pickler, else Ray's
    cloudpickle, which also takes lambdas and local classes) into at most MAX_METADATA_BYTES."""
    if metadata is None:
        return
    try:
        try:
            pickle.Pickler(_SizeBound(MAX_METADATA_BYTES), protocol=5).dump(metadata)
        except _TooBig:
            raise
        except Exception:
            from ray import cloudpickle
            cloudpickle.CloudPickler(_SizeBound(MAX_METADATA_BYTES), protocol=5).dump(metadata)
    except _TooBig:
        raise ValueError(f"{what}: over {MAX_METADATA_BYTES} bytes (1 MiB) pickled, the bound on one request's metadata "
                         "(the service holds it while the request is in flight and copies it onto each of its "
                         "results): keep large task data elsewhere, e.g. looked up by an id in the reward "
                         "function") from None
    except Exception as e:  # whatever a __reduce__ raises: TypeError, PicklingError, AttributeError, ...
        raise ValueError(f"{what}: cannot be pickled, as it must be to reach the rollout workers "
                         f"({type(e).__name__}: {e})") from None


_REWARD_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")  # dotted module path : function


def check_reward_name(name: Any, what: str = "reward") -> str | None:
    """None, or a reward function's importable name "package.module:function" (not imported here)."""
    if name is None:
        return None
    if not isinstance(name, str) or not _REWARD_NAME.fullmatch(name):
        raise ValueError(f"{what}={name!r}: must be an importable \"module:function\" name (or None)")
    return name


def check_completion(completion: Any, sampling: Any, episode: Any) -> list[int] | None:
    """A completion to score (RolloutRequest.completion): a non-empty list of token ids, on a plain request of
    one sample whose sampling needs no history (penalties would depend on each scored prefix)."""
    if completion is None:
        return None
    if isinstance(completion, (str, bytes)) or not isinstance(completion, (list, tuple)) or not completion or \
            not all(is_int(t) and 0 <= t <= MAX_INT32 for t in completion):
        raise ValueError("RolloutRequest.completion: must be None or a non-empty list of token ids (ints >= 0)")
    if episode is not None:
        raise ValueError("RolloutRequest.completion: an episode generates its turns; it cannot score a completion")
    penalties = (getattr(sampling, "repetition_penalty", 1.0) != 1.0 or getattr(sampling, "frequency_penalty", 0)
                 or getattr(sampling, "presence_penalty", 0))
    if getattr(sampling, "n", 1) != 1 or penalties:
        raise ValueError("RolloutRequest.completion: scoring takes sampling with n=1 and no penalties")
    if getattr(sampling, "return_routed_experts", False):
        raise ValueError("RolloutRequest.completion: scoring does not return routed experts")
    return [int(t) for t in completion]


def check_stream_tokens(stream_tokens: Any, completion: Any, episode: Any) -> None:
    if not isinstance(stream_tokens, bool):
        raise ValueError(f"RolloutRequest.stream_tokens={stream_tokens!r}: must be a bool")
    if stream_tokens and (completion is not None or episode is not None):
        raise ValueError("RolloutRequest.stream_tokens: only a plain completion streams its tokens (not a scored "
                         "completion, not an episode)")


def engine_device(device: str | None) -> "torch.device":
    """EngineConfig.device as a torch.device (None: cuda when visible, else cpu); ValueError in one line when it
    names CUDA and no CUDA device is visible (torch's own error is an assertion deep in its init)."""
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"EngineConfig.device={device!r}: no CUDA device is visible to this process (torch "
                         f"{torch.__version__}, CUDA build {torch.version.cuda}); use device='cpu' or leave it unset")
    return dev
