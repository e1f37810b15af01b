"""Model ops (attention, rope, rmsnorm): a torch reference and a CUDA backend, chosen in backend.py."""
from rollout_service.ops.attention import AttentionMetadata
from rollout_service.ops.backend import Ops, resolve_backend, select_ops

__all__ = ["AttentionMetadata", "Ops", "resolve_backend", "select_ops"]
