"""A result whose log-probs turned NaN or inf: the forward overflowed, and what the engine reports instead of a
success full of NaN (the sequence ends there as an "abort" with this error; weights/canary.py refuses the refreshes
that would cause it up front)."""
from __future__ import annotations

import math


def overflow_error(logprobs, offset: int = 0, scoring: bool = False) -> str | None:
    """The error of a result whose log-probs are NaN or inf (the forward overflowed: weights or inputs out of
    range), None when they are finite. Scoring keeps -inf: a target outside a truncated (top-k / top-p)
    distribution has log-prob -inf there."""
    for i, lp in enumerate(logprobs):
        if math.isnan(lp) or lp == math.inf or (lp == -math.inf and not scoring):
            return (f"non-finite log-prob ({lp}) at output token {offset + i}: the model's forward overflowed "
                    "(inf or NaN logits), so its weights or inputs are out of range; the tokens from there on "
                    "are not the policy's")
    return None
