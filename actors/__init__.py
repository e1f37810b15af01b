"""Ray actors of the rollout service: RolloutWorker (owns an Engine), Router (dispatch, faults,
refresh) and Learner (the learner-side actor a training loop builds on)."""
