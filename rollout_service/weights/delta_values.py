"""How a delta sends the new values of its changed elements: raw (the dtype's bytes), or as steps from the base.

A step is how many representable values of the dtype lie between an element's base value and its new one: the
bit pattern read as sign and magnitude, mapped to an ordered integer (-0.0 and 0.0 adjacent). After an optimizer
step at RL learning rates a changed bf16 element moves by one or a few ulps: its step fits one signed byte, half
the bytes of its value. A step of ESCAPE stands for a raw value, sent after the steps in the same order (an
element near zero that moved by many of its tiny ulps). Applying steps is integer arithmetic on the base's bit
patterns: the result is still bit for bit the new tensor. Raw it is when steps would not be smaller (fp32, or
too many escapes).
"""
from __future__ import annotations

import torch

ESCAPE = -128  # an int8 step that stands for a raw value; steps are -127..127
_INT = {2: torch.int16, 4: torch.int32}  # dtypes sent as steps: 2 and 4-byte floats
_ALIGN = 8


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


_WORK = {2: torch.int32, 4: torch.int64}  # wide enough for an ordered value plus a step


def ordered(t: torch.Tensor) -> torch.Tensor:
    """Each element's place among the dtype's values: the bits as sign-magnitude, ordered. A negative pattern
    (sign bit set, read as a signed integer) has its magnitude bits flipped, so -0.0 is -1 and 0.0 is 0; in the
    narrowest integer that holds a step more (int32 for 2-byte floats: half the memory traffic of int64)."""
    size = t.element_size()
    x = t.view(_INT[size]).to(_WORK[size])
    return x ^ ((x >> 8 * _WORK[size].itemsize - 1) & ((1 << 8 * size - 1) - 1))


def takes_steps(itemsize: int) -> bool:
    """Whether values of this many bytes can be sent as steps."""
    return itemsize in _INT


def _from_ordered(o: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ordered (the same flip) for values within the dtype's range."""
    x = o ^ ((o >> 8 * o.element_size() - 1) & ((1 << 8 * dtype.itemsize - 1) - 1))
    return x.to(_INT[dtype.itemsize]).view(dtype)


def values_nbytes(count: int, itemsize: int, steps: bool, raws: int) -> int:
    """Bytes of `count` values sent raw, or as steps with `raws` escapes."""
    return _aligned(count) + raws * itemsize if steps else count * itemsize


def encode_values(new: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, bool, int]:
    """(bytes, sent as steps, escapes) of the 1-D `new` values whose base values are `old`, whichever is smaller."""
    raw = new.contiguous().view(torch.uint8)
    if not takes_steps(new.element_size()) or not new.numel():
        return raw, False, 0
    step = ordered(new) - ordered(old)
    far = step.abs() > 127
    raws = int(far.sum())
    if values_nbytes(new.numel(), new.element_size(), True, raws) >= _aligned(raw.numel()):
        return raw, False, 0
    out = torch.zeros(values_nbytes(new.numel(), new.element_size(), True, raws), dtype=torch.uint8,
                      device=new.device)
    out[:new.numel()] = torch.where(far, ESCAPE, step).to(torch.int8).view(torch.uint8)
    out[_aligned(new.numel()):] = new[far].contiguous().view(torch.uint8)
    return out, True, raws


def decode_values(data: torch.Tensor, count: int, dtype: torch.dtype, steps: bool, raws: int,
                  old: torch.Tensor | None) -> torch.Tensor | str:
    """The `count` new values from their bytes (`old`: their base values, for steps); a str says what is corrupt."""
    if not steps:
        return data.view(dtype)
    if not takes_steps(dtype.itemsize):
        return f"its values come as steps, which a {str(dtype).removeprefix('torch.')} weight does not take"
    step = data[:count].view(torch.int8).to(_WORK[dtype.itemsize])
    far = step == ESCAPE
    if int(far.sum()) != raws:
        return f"its steps escape to {int(far.sum())} raw values, it sends {raws}"
    o = ordered(old.reshape(-1)) + step
    if raws:
        o[far] = ordered(data[_aligned(count):_aligned(count) + raws * dtype.itemsize].view(dtype))
    half = 1 << 8 * dtype.itemsize - 1
    if count and not (-half <= int(o.min()) and int(o.max()) < half):
        return "a step leaves the dtype's values"
    return _from_ordered(o, dtype)
