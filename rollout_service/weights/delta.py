"""A delta refresh's encoding: only the elements that changed since the version the workers hold.

Between two RL steps most weights do not change at all in the engine's dtype: an fp32 update far below half a
bf16 ulp rounds back to the same bf16. The sender compares each new tensor, cast to the engine's dtype, bit for
bit with the one it pushed last (the base) and sends, per bucket of the dense layout (buckets.py), whichever is
smaller: the bucket's dense bytes, or per tensor the positions that changed and their new values. New values,
not differences: applying them is a copy, so the weights are bit for bit those a dense push of the same tensors
gives (equal weights_digest), however long the chain of deltas.

Positions are sorted flat indices sent as gaps, one code of 1 or 2 bytes each (whichever is smaller for that
tensor): code g > 0 says "the next changed element is g past the previous one" (the first counts from -1), code
0 says "skip SKIP elements and read on" (a gap larger than a code holds). At 1% changed elements a gap averages
100: about one byte per position instead of an int64's eight. A tensor whose positions would cost more than its
dense bytes is sent whole inside a sparse bucket (width 0, no codes). The values come raw or, mostly, as one-byte
steps from the base value (delta_values.py).

Decoding checks everything before anything is written (`decode` returns the writes, `apply` does them): the
layout against the manifest, each tensor's count and positions, every value finite and within the canary's bound
(canary.py). A corrupt delta is a ValueError naming the weight.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from rollout_service.api.values import is_int
from rollout_service.weights.buckets import Buckets, as_bytes
from rollout_service.weights.canary import LIMIT
from rollout_service.weights.delta_values import (ESCAPE, decode_values, encode_values, ordered, takes_steps,
                                                  values_nbytes)
from rollout_service.weights.manifest import BucketCode, DeltaPlan, Manifest, SparseTensor, TensorEntry

WIDTHS = (1, 2)
SKIP = {1: 255, 2: 65535}  # elements an escape code (0) skips, per code width
_CODES = {1: torch.uint8, 2: torch.int16}
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ALIGN = 8  # codes and values start 8-byte aligned: zero-copy views for any dtype


@dataclass(frozen=True)
class Write:
    """A validated write into one weight: `values` at flat `index` (None: the whole tensor)."""
    name: str
    index: torch.Tensor | None
    values: torch.Tensor


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


# -- positions ----------------------------------------------------------------------------------------

def _steps(index: torch.Tensor) -> torch.Tensor:
    return torch.diff(index, prepend=index.new_full((1,), -1))  # each >= 1: the positions increase


def code_count(index: torch.Tensor, width: int) -> int:
    """Codes that `index` takes at `width` bytes each: one per position plus the escapes of long gaps."""
    return index.numel() + int(((_steps(index) - 1) // SKIP[width]).sum()) if index.numel() else 0


def encode_positions(index: torch.Tensor, width: int) -> torch.Tensor:
    """The gap codes of increasing positions, as bytes (little-endian for width 2)."""
    return _gap_codes(_steps(index), width, code_count(index, width))


def _gap_codes(gaps: torch.Tensor, width: int, n: int) -> torch.Tensor:
    """The `n` codes of position gaps (each >= 1) at `width` bytes, escapes included."""
    if n == gaps.numel():  # no gap needs an escape (the usual case): each gap is its code
        return gaps.to(_CODES[width]).view(torch.uint8)  # (65535 as int16 keeps its bits)
    skips = (gaps - 1) // SKIP[width]
    at = torch.cumsum(skips + 1, 0) - 1  # each position's own code comes after its escapes
    codes = torch.zeros(n, dtype=torch.int32, device=gaps.device)
    codes[at] = (gaps - skips * SKIP[width]).to(torch.int32)  # 1..SKIP
    return codes.to(_CODES[width]).view(torch.uint8)  # (65535 as int16 keeps its bits)


def decode_positions(codes: torch.Tensor, width: int, count: int, numel: int, name: str) -> torch.Tensor:
    """Positions from gap codes (bytes); ValueError unless they are `count` positions within `numel`."""
    # int32 wherever no sum of these codes can pass it (half the memory traffic of int64)
    work = torch.int32 if codes.numel() // width * SKIP[width] < 2**31 else torch.int64
    raw = codes.view(_CODES[width]).to(work) & (1 << 8 * width) - 1
    if codes.numel() != count * width or not count:
        real = raw != 0
        index = (torch.cumsum(torch.where(real, raw, SKIP[width]), 0, dtype=work) - 1)[real]
        held, last = index.numel(), int(index[-1]) if index.numel() else -1
    else:  # as many codes as positions (the usual case): no escapes, unless one is a 0, which is corrupt
        index = torch.cumsum(raw, 0, dtype=work) - 1
        escapes, last = torch.stack([(raw == 0).sum().to(work), index[-1]]).tolist()  # one read back
        held = count - escapes
    if held != count:
        raise ValueError(_corrupt(name, f"it counts {count} changed elements but its position codes hold {held}"))
    if last >= numel:
        raise ValueError(_corrupt(name, f"a position ({last}) lies past its {numel} elements"))
    return index


# -- encoding (the sender) --------------------------------------------------------------------------

def encode(manifest: Manifest, items: Sequence[tuple[str, torch.Tensor]], base: Buckets,
           base_version: int, checked: bool = True) -> tuple[DeltaPlan, list[torch.Tensor]]:
    """The delta from `base` (the dense buckets of `base_version`, laid out by `manifest`) to `items` (the same
    names in manifest order, any dtype: cast to the manifest's), and the buckets to send (uint8, on base's
    device): per bucket the dense bytes or the changed elements, whichever is smaller. A bucket is compared in
    one pass and its tensors' choices read back at once (not a pass and a read back per tensor: a model has
    hundreds of tensors, and on a GPU each read back waits for the device)."""
    members: list[list[tuple[TensorEntry, torch.Tensor]]] = [[] for _ in manifest.bucket_sizes]
    for e, (_, t) in zip(manifest.entries, items):
        members[e.bucket].append((e, t))
    position = {e.name: k for k, e in enumerate(manifest.entries)}
    codes, buffers = [], []
    for b, size in enumerate(manifest.bucket_sizes):
        new = _dense_bucket(members[b], base.buffers[b])
        found = _changes(members[b], new, base.buffers[b])
        layout = None if found is None else _layout(members[b], found, size)
        if layout is None:
            codes.append(BucketCode(size))
            buffers.append(new)
        else:
            code, buf = _sparse_bucket(members[b], layout, found, new, base.buffers[b], position)
            codes.append(code)
            buffers.append(buf)
    return DeltaPlan(base_version, tuple(codes), checked), buffers


def _dense_bucket(members, base: torch.Tensor) -> torch.Tensor:
    """The bucket of the new tensors, cast to the manifest's dtypes; its padding is the base's, so only the
    tensors can differ."""
    buf, end = torch.empty_like(base), 0
    for e, _ in members:  # the padding before each tensor, and after the last
        buf[end:e.offset] = base[end:e.offset]
        end = e.offset + e.nbytes
    buf[end:] = base[end:]
    for e, t in members:
        if e.nbytes:
            buf[e.offset:e.offset + e.nbytes].view(e.torch_dtype()).view(e.shape).copy_(t.detach())
    return buf


@dataclass
class _Changes:
    """A bucket's changed elements in position order: for each, its tensor's gap from that tensor's previous
    change (the first counts from -1), its new value and its value step from the base (delta_values.py)."""
    gap: torch.Tensor
    values: torch.Tensor
    step: torch.Tensor | None     # None: a dtype whose values go raw
    far: torch.Tensor | None      # steps that do not fit a byte: those values go raw
    escaped: torch.Tensor | None  # the changes whose values go raw, in order
    counts: list[list[int]]       # per member: [changes, escape codes at width 1, at width 2, raw values]


def _changes(members, new: torch.Tensor, base: torch.Tensor) -> _Changes | None:
    """Every changed element of a bucket (bitwise: -0.0 vs 0.0 or two NaNs count as they are stored); None for
    a bucket of mixed dtypes (a delta's manifest has one), which goes dense. Work per changed element is a few
    element-wise passes; what is per tensor (its first change, long gaps, raw values: all rare) is found
    sparsely, so the cost follows the changes, not the tensors."""
    if not members:
        return None
    dtype = members[0][0].torch_dtype()
    size = dtype.itemsize
    if any(e.torch_dtype() != dtype for e, _ in members) or size not in _BITS or base.numel() % size:
        return None
    index = torch.nonzero(new.view(_BITS[size]) != base.view(_BITS[size])).reshape(-1)
    starts = torch.tensor([e.offset // size for e, _ in members], dtype=torch.int64, device=new.device)
    # the members lie in offset order and padding never changes: each member's changes are one run of index
    first = torch.searchsorted(index, starts)
    ends = torch.cat([first[1:], first.new_full((1,), index.numel())])
    gap = torch.diff(index, prepend=index.new_full((1,), -1))
    changed = first < ends
    heads = first[changed]  # a member's first change counts from -1 within it
    gap[heads] = index[heads] - starts[changed] + 1
    values = new.view(dtype)[index]
    long = torch.nonzero(gap > SKIP[1]).reshape(-1)  # gaps that take escape codes at width 1 (and maybe 2)
    skips = [_per_member(first, long, (gap[long] - 1) // SKIP[w]) for w in WIDTHS]
    step = far = escaped = None
    raws = torch.zeros_like(first)
    if takes_steps(size):
        step = ordered(values) - ordered(base.view(dtype)[index])
        far = step.abs() > 127
        escaped = torch.nonzero(far).reshape(-1)
        raws = _per_member(first, escaped, torch.ones_like(escaped))
    counts = torch.stack([ends - first, *skips, raws], 1).tolist()  # the bucket's one read back
    return _Changes(gap, values, step, far, escaped, counts)


def _per_member(first: torch.Tensor, at: torch.Tensor, amounts: torch.Tensor) -> torch.Tensor:
    """Per member, the sum of `amounts` over the changes at positions `at` (a member's changes start at `first`)."""
    member = torch.searchsorted(first, at, right=True) - 1
    return torch.zeros_like(first).index_add_(0, member, amounts)


@dataclass(frozen=True)
class _Choice:
    """How one changed tensor is sent: its changes [lo, hi) in _Changes, position codes of `width` bytes (0:
    the tensor whole), values as steps or raw."""
    member: int
    lo: int
    hi: int
    width: int
    codes: int
    steps: bool
    raws: int
    cost: int


def _layout(members, found: _Changes, size: int) -> list[_Choice] | None:
    """Per changed tensor the smallest way to send it; None when the bucket is smaller sent dense."""
    out, total, lo = [], 0, 0
    for k, ((e, _), (n, skip1, skip2, raws)) in enumerate(zip(members, found.counts)):
        if not n:
            continue
        item, numel = e.torch_dtype().itemsize, math.prod(e.shape)
        codes = {1: n + skip1, 2: n + skip2}
        width = min(WIDTHS, key=lambda w: codes[w] * w)
        steps = found.step is not None and values_nbytes(n, item, True, raws) < _aligned(n * item)
        cost = _aligned(codes[width] * width) + _aligned(values_nbytes(n, item, steps, raws))
        choice = _Choice(k, lo, lo + n, width, codes[width], steps, raws if steps else 0, cost)
        if cost >= _aligned(numel):  # sent whole (steps: 1 byte an element) may be smaller
            whole = found.step is not None and values_nbytes(numel, item, True, raws) < _aligned(numel * item)
            whole_cost = _aligned(values_nbytes(numel, item, whole, raws))
            if whole_cost < cost:
                choice = _Choice(k, lo, lo + n, 0, 0, whole, raws if whole else 0, whole_cost)
        out.append(choice)
        total += choice.cost
        lo += n
        if total >= size:
            return None
    return out


def _sparse_bucket(members, layout: list[_Choice], found: _Changes, new: torch.Tensor, base: torch.Tensor,
                   position: dict[str, int]) -> tuple[BucketCode, torch.Tensor]:
    escaped = found.escaped
    raws_before = [0]
    for n, _, _, raws in found.counts:
        raws_before.append(raws_before[-1] + raws)
    parts = []  # per tensor: (its SparseTensor less offsets, codes bytes or None, values bytes)
    for c in layout:
        e = members[c.member][0]
        dtype = e.torch_dtype()
        if not c.width:  # whole
            lo, hi = e.offset, e.offset + e.nbytes
            values, steps, raws = encode_values(new[lo:hi].view(dtype), base[lo:hi].view(dtype))
            parts.append((e, math.prod(e.shape), 0, 0, None, values, steps, raws))
            continue
        codes = _gap_codes(found.gap[c.lo:c.hi], c.width, c.codes)
        if c.steps:
            r0 = raws_before[c.member]
            steps = torch.where(found.far[c.lo:c.hi], ESCAPE, found.step[c.lo:c.hi]).to(torch.int8)
            raw = found.values[escaped[r0:r0 + c.raws]] if c.raws else found.values[:0]
            values = torch.zeros(values_nbytes(c.hi - c.lo, dtype.itemsize, True, c.raws), dtype=torch.uint8,
                                 device=new.device)
            values[:c.hi - c.lo] = steps.view(torch.uint8)
            values[_aligned(c.hi - c.lo):] = raw.contiguous().view(torch.uint8)
        else:
            values = found.values[c.lo:c.hi].contiguous().view(torch.uint8)
        parts.append((e, c.hi - c.lo, c.width, c.codes, codes, values, c.steps, c.raws))
    size = sum((_aligned(codes.numel()) if codes is not None else 0) + _aligned(values.numel())
               for *_, codes, values, _, _ in parts)
    buf = torch.zeros(max(size, _ALIGN), dtype=torch.uint8, device=new.device)  # (nothing changed: 8 bytes)
    at, out = 0, []
    for e, count, width, n, codes, values, steps, raws in parts:
        codes_at = at
        if codes is not None:
            buf[at:at + codes.numel()] = codes
            at += _aligned(codes.numel())
        buf[at:at + values.numel()] = values
        out.append(SparseTensor(position[e.name], count, width, n, codes_at, at, steps, raws))
        at += _aligned(values.numel())
    return BucketCode(buf.numel(), tuple(out)), buf


# -- decoding (the receiver, and the sender's own base) ----------------------------------------------

def _corrupt(name: str, what: str) -> str:
    return f"update_weights: the delta for {name!r} is corrupt: {what}; nothing was changed"


def decode(manifest: Manifest, plan: DeltaPlan, buffers: Sequence, base: dict[str, torch.Tensor]) -> list[Write]:
    """Every write a delta makes, each checked (ValueError naming the weight); nothing is written. `base`: the
    weights of the base version by name (values sent as steps start from them)."""
    if not isinstance(plan, DeltaPlan) or not is_int(plan.base_version):
        raise ValueError(f"update_weights: a delta's plan must be a DeltaPlan, got {type(plan).__name__}")
    if not len(plan.buckets) == len(manifest.bucket_sizes) == len(buffers):
        raise ValueError(f"update_weights: the delta has {len(plan.buckets)} bucket codes and {len(buffers)} "
                         f"buffers for {len(manifest.bucket_sizes)} buckets; nothing was changed")
    writes = [w for b, (code, buf) in enumerate(zip(plan.buckets, buffers))
              for w in _decode_bucket(manifest, b, code, as_bytes(buf), base)]
    if plan.checked is not False:
        _check_values(writes)
    return writes


def _decode_bucket(manifest: Manifest, b: int, code: BucketCode, buf: torch.Tensor,
                   base: dict[str, torch.Tensor]) -> list[Write]:
    if not isinstance(code, BucketCode) or buf.numel() != code.nbytes:
        raise ValueError(f"update_weights: the delta's bucket {b} holds {buf.numel()} bytes, its code says "
                         f"{getattr(code, 'nbytes', None)}; nothing was changed")
    if code.sparse is None:
        if code.nbytes != manifest.bucket_sizes[b]:
            raise ValueError(f"update_weights: the delta's dense bucket {b} holds {code.nbytes} bytes, the "
                             f"manifest's {manifest.bucket_sizes[b]}; nothing was changed")
        writes = [Write(e.name, None, buf[e.offset:e.offset + e.nbytes].view(e.torch_dtype()))
                  for e in manifest.entries if e.bucket == b]
    else:
        seen: set[int] = set()
        writes = [_sparse_write(manifest, b, s, buf, seen, base) for s in code.sparse]
    return writes


def _sparse_write(manifest: Manifest, b: int, s: SparseTensor, buf: torch.Tensor, seen: set[int],
                  base: dict[str, torch.Tensor]) -> Write:
    fields = (s.entry, s.count, s.width, s.codes, s.codes_at, s.values_at, s.raws) \
        if isinstance(s, SparseTensor) and isinstance(s.steps, bool) else ()
    if not fields or not all(is_int(f) and f >= 0 for f in fields) or s.entry >= len(manifest.entries):
        raise ValueError(f"update_weights: the delta's bucket {b} lists a malformed tensor; nothing was changed")
    e = manifest.entries[s.entry]
    dtype = e.torch_dtype()
    numel, size = math.prod(e.shape), dtype.itemsize
    why = None
    if e.bucket != b or s.entry in seen:
        why = f"it is listed in bucket {b}" + (" twice" if s.entry in seen else f", the manifest puts it in {e.bucket}")
    elif s.width not in (0, *WIDTHS):
        why = f"its position codes are {s.width} bytes wide (1 or 2, or 0 for the whole tensor)"
    elif s.width == 0 and (s.count != numel or s.codes):
        why = f"it is sent whole with {s.count} of its {numel} elements"
    elif s.width and not 0 < s.count <= min(s.codes, numel):
        why = f"it counts {s.count} changed elements of {numel} in {s.codes} position codes"
    elif s.values_at % (1 if s.steps else size) or (s.width and s.codes_at % s.width):
        why = "its codes or values are misaligned"
    elif s.values_at + values_nbytes(s.count, size, s.steps, s.raws) > buf.numel() or \
            s.codes_at + s.codes * s.width > buf.numel():
        why = f"its codes or values run past the bucket's {buf.numel()} bytes"
    elif s.raws > s.count or (s.raws and not s.steps):
        why = f"it sends {s.raws} raw values after {s.count} {'steps' if s.steps else 'values'}"
    if why:
        raise ValueError(_corrupt(e.name, why))
    seen.add(s.entry)
    index = None if s.width == 0 else \
        decode_positions(buf[s.codes_at:s.codes_at + s.codes * s.width], s.width, s.count, numel, e.name)
    old = None
    if s.steps:
        flat = base[e.name].reshape(-1)
        old = (flat if index is None else flat[index.to(flat.device)]).to(buf.device)
    values = decode_values(buf[s.values_at:s.values_at + values_nbytes(s.count, size, s.steps, s.raws)], s.count,
                           dtype, s.steps, s.raws, old)
    if isinstance(values, str):
        raise ValueError(_corrupt(e.name, values))
    return Write(e.name, index, values)


def _check_values(writes: Sequence[Write]) -> None:
    """Every value finite and within the canary's bound (a larger element fails the canary the learner ran on the
    whole tensor: weights/canary.py), so a corrupt delta cannot bring what a dense push would have been refused.
    One read back per device, not one per tensor."""
    tops: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for w in writes:
        if w.values.numel():
            tops.setdefault(w.values.device, []).append((w.name, w.values.abs().max().float()))
    for found in tops.values():
        for (name, _), top in zip(found, torch.stack([t for _, t in found]).tolist()):
            if not top <= LIMIT:  # NaN and inf survive the max
                what = "a value is NaN or inf" if not math.isfinite(top) else \
                    f"a value is {top:.3g}, beyond the canary's bound {LIMIT:.0e}"
                raise ValueError(_corrupt(name, what))


def apply(writes: Sequence[Write], weights: dict[str, torch.Tensor]) -> None:
    """Do checked writes into contiguous tensors by name (an engine's weights: live views of its parameters)."""
    for w in writes:
        flat = weights[w.name].view(-1)
        if w.index is None:
            flat.copy_(w.values)
        else:
            flat[w.index.to(flat.device)] = w.values.to(flat.device)
