"""What counts as an int, a number and a real number at every boundary of the service: one vocabulary for every
check (API arguments, configs, wire records, reports). A bool is never a number here, though Python makes it an
int: `n=True` is a mistake to refuse, not a 1. numpy's scalars count as Python's do."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

MAX_INT32 = 2**31 - 1  # token ids and policy versions travel as int32 (RolloutResult's wire format)


def is_int(x: Any) -> bool:
    """An integer: int or numpy integer, not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)  # concrete types: checked per token


def is_number(x: Any) -> bool:
    """An int or a float (numpy's too), not a bool; NaN and infinities included (is_real excludes them)."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def is_real(x: Any) -> bool:
    """A finite number (any int is finite; math.isfinite would overflow on a huge one)."""
    return is_number(x) and (is_int(x) or math.isfinite(x))
