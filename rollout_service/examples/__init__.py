"""Examples that ship with the service: a verifiable arithmetic task (tasks.py), a calculator-tool environment
for multi-turn episodes (calculator_env.py) and the prompts `rollout-service run` uses when a config names no
prompts file (sample_prompts.py)."""
