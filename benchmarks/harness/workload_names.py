"""The workloads the harness knows, in run order (benchmarks/README.md defines each); a module of its own so that
`--help` and the harness both read it without importing each other."""

# Run order = priority when a time budget runs out: the headline rollout and latency figures, then the
# cheap ones, then the longest: W2n and W2p (its prefill-heavy twin, long prompts). Workloads after W3 run on
# the refreshed weights, which the engine and the peers then share just the same. W6 (an RL step in a Ray
# service) needs only the model's config, so it runs before the model is loaded in this process. W7
# (multi-turn episodes, prefix cache on vs off) and WDS (dynamic sampling's overhead) are the RL-rollout
# features'. WBI: batch-invariant mode's cost on W2's and W2n's shapes and its bitwise check. WM (one MoE
# layer's experts, each way the cuda backend can run them; config only) and WMF (an MoE learner's recompute with
# and without routing replay) are the mixture-of-experts models'. W2w: W2 at an RL batch (1024 sequences);
# W2fp8 / W1fp8: W2 and W1 with FP8 rollouts (their HF peers are W2's and W1's); WP: a decode step's GPU time
# by kernel class at W2's and W2w's batch (torch.profiler); W6fp8: W6 with FP8 rollouts and TIS. W2c / W1c: W2
# and W1 with two busy neighbour processes (CPU contention), engine and HF alike. WD (delta refreshes after real
# optimizer steps, dense vs delta) trains the weights in place, like W3 a refresh: it runs right after W3.
WORKLOADS = ("W6", "W6fp8", "WM", "W2", "W1", "W5", "W2fp8", "W1fp8", "W2w", "WP", "WMF", "W3", "WD", "W4", "W2n", "W2p",
             "W7", "WDS", "WBI", "W2c", "W1c")
