"""Rewards: reward functions named "package.module:function" and how they are checked and called
(functions.py), where the service computes them (runner.py), and examples to try or test with (examples.py:
`rollout_service.rewards.examples:length_reward` and others)."""
