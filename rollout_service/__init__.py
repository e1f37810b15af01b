"""rollout_service: a distributed rollout service for RL post-training of language models."""
from rollout_service.api.deltas import TokenDelta
from rollout_service.api.types import RolloutRequest, RolloutResult, SamplingParams

__all__ = ["RolloutClient", "RolloutRequest", "RolloutResult", "SamplingParams", "TokenDelta",
           "logprob_mismatch", "mismatch_report"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The client pulls in torch and the engine; keep `import rollout_service.api.types` light for wire-only users.
    if name == "RolloutClient":
        from rollout_service.client import RolloutClient
        return RolloutClient
    if name in ("logprob_mismatch", "mismatch_report"):
        from rollout_service.training import mismatch
        return getattr(mismatch, name)
    raise AttributeError(f"module 'rollout_service' has no attribute {name!r}")
