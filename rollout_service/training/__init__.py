"""The learner side of an RL step: training precision, memory figures, and the clock of a step's phases."""
from rollout_service.training.memory import LearnerOutOfMemory, memory_figures
from rollout_service.training.phases import StepClock
from rollout_service.training.precision import OPTIMIZERS, MasterWeights

__all__ = ["LearnerOutOfMemory", "MasterWeights", "OPTIMIZERS", "StepClock", "memory_figures"]
