"""The learner side of an RL step: training precision, memory figures, the clock of a step's phases, the bitwise
recompute of a batch-invariant engine's log-probs, the replay of a mixture-of-experts engine's routing, and the
importance weights that correct for the engine's numerics."""
from rollout_service.training.importance import importance_weights
from rollout_service.training.invariant_forward import InvariantForward, Verdict
from rollout_service.training.memory import LearnerOutOfMemory, memory_figures
from rollout_service.training.phases import StepClock
from rollout_service.training.precision import OPTIMIZERS, MasterWeights
from rollout_service.training.routing_replay import RoutingStats, replay_routing

__all__ = ["InvariantForward", "LearnerOutOfMemory", "MasterWeights", "OPTIMIZERS", "RoutingStats", "StepClock",
           "Verdict", "importance_weights", "memory_figures", "replay_routing"]
