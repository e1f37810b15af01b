"""The learner's side of delta refreshes: when a push may be a delta, and the base it is computed from.

`update_weights(..., delta=)`:
  "auto" (default): a push through the object store or a broadcast is sent in the engine's dtype and, once the
         learner holds the base the workers run, as a delta (delta.py) unless dense pushes have been faster on
         this service (PushPace: on one box a dense push only crosses shared memory, and finding the changes can
         cost more than it saves); a partial push, CUDA IPC (which copies no bytes) and FP8 engines (which
         quantize on apply) are sent dense, as given, and free the base;
  True:  a delta whenever the base allows, however long it takes; a push that can never be a delta (partial, CUDA
         IPC, an FP8 engine) is refused, saying why;
  False: dense, as given; the base is freed.
A push with no base yet (the first one, the first after a dense push of another kind) is dense and fills the
base. When the service does not run the base's version (another client pushed, a push failed part-way) or some
worker does not hold it (restarted, newly added, asleep with its weights dropped), the router or that worker
refuses the delta (NO_BASE) before anything changes, and the learner pushes the same weights dense to every
worker at once: one payload and one replay-log entry per refresh, which re-bases every worker, for a case that
costs one dense push when it happens.

The base (`DeltaSender`): the tensors of the last push, cast to the engine's dtype, in the dense bucket layout,
on the device the learner's tensors are on (its GPU: the comparison then runs at device bandwidth and only the
changed elements cross to the host; host memory for CPU tensors). Memory: one copy of every pushed weight in the
engine's dtype on that device (2 bytes per parameter in bf16: 16 GB for llama3-8b), plus the buffers of the push
in flight (the changed elements; a whole bucket's bytes for a bucket sent dense). `release` (delta=False, or
release_weight_buffers) frees it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from rollout_service.weights.buckets import Buckets, Manifest, reuse_or_allocate
from rollout_service.weights.delta import DeltaPlan, encode

DELTA_MODES = ("auto", True, False)
PROBE_EVERY = 8      # under "auto", the kind that has been slower is timed again once every this many pushes
PACE_WEIGHT = 0.5    # weight of a push's seconds in its kind's running figure (an EMA)


class PushPace:
    """Seconds per push of each kind, delta and dense in the engine's dtype (the same pipeline), on one service:
    which one delta="auto" sends. Both are timed before the choice is made (a delta first: the first push is
    dense anyway); then the faster goes, and the other once every PROBE_EVERY pushes, since a delta's cost follows
    the learning rate and a dense push's the network between learner and workers."""

    def __init__(self) -> None:
        self.seconds: dict[bool, float] = {}
        self.pushes = 0
        self.last_probe = 0

    def prefer_delta(self) -> bool:
        delta, dense = self.seconds.get(True), self.seconds.get(False)
        if delta is None or dense is None:
            return delta is None
        faster = delta <= dense
        return faster if self.pushes - self.last_probe < PROBE_EVERY else not faster

    def note(self, delta: bool, seconds: float) -> None:
        """A push of that kind took `seconds` (pack, send and every worker's apply)."""
        old = self.seconds.get(delta)
        self.seconds[delta] = seconds if old is None else old + PACE_WEIGHT * (seconds - old)
        self.pushes += 1
        if len(self.seconds) == 2 and self.seconds[delta] > self.seconds[not delta]:
            self.last_probe = self.pushes  # the slower kind ran: it runs again PROBE_EVERY pushes later


def check_delta(delta: Any) -> None:
    """ValueError unless `delta` is "auto", True or False."""
    if not (delta is True or delta is False or (isinstance(delta, str) and delta == "auto")):
        raise ValueError(f"update_weights: delta={delta!r}; choose one of {DELTA_MODES}")


def delta_refusal(transport: str, partial: bool, quantization: str | None) -> str | None:
    """Why no push of this kind can be a delta (None: it can). delta=True raises it; "auto" sends dense."""
    if partial:
        return ("update_weights: delta=True needs every weight (partial=False): a delta is taken against the "
                "whole base; a partial push is sent dense (delta='auto' or False)")
    if quantization == "fp8":
        return ("update_weights: delta=True: the workers' engines quantize every refresh to FP8 "
                "(EngineConfig.quantization='fp8'), and each channel's scale depends on the whole tensor, so "
                "changed bf16 elements cannot be patched into FP8 weights exactly; use delta='auto' or False")
    if transport == "cuda_ipc":
        return ("update_weights: delta=True: CUDA IPC copies no bytes to save (the workers read the learner's GPU "
                "buckets), so it stays dense; use delta='auto', or transport='object_store' or 'broadcast'")
    return None


def delta_dtype(delta: Any, transport: str, partial: bool, targets: Sequence[dict]) -> torch.dtype | None:
    """The engine dtype a push is sent in, for the delta pipeline; None: dense, as given. `targets`: the workers,
    as the router's weight_targets reports them."""
    check_delta(delta)
    if delta is False:
        return None
    quantization = next((t.get("quantization") for t in targets if t.get("quantization")), None)
    why = delta_refusal(transport, partial, quantization)
    if why is not None:
        if delta is True:
            raise ValueError(why)
        return None
    dtypes = {t.get("weights_dtype") for t in targets}
    name = dtypes.pop() if len(dtypes) == 1 else None
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


@dataclass
class Wire:
    """What one push sends: the buckets (uint8 tensors) and, for a delta, its plan (None: the dense layout)."""
    buffers: list[torch.Tensor]
    plan: DeltaPlan | None = None

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)


class DeltaSender:
    """The base: the dense buckets of the last push that every worker took, and that push's version."""

    def __init__(self) -> None:
        self.base: Buckets | None = None
        self.version: int | None = None  # None: the base holds no version the service ran (being overwritten)

    def wire(self, manifest: Manifest, items: Sequence[tuple[str, torch.Tensor]], delta: bool = True,
             checked: bool = True) -> Wire:
        """The buckets of a push of `items` (in manifest order): a delta against the base when it holds a version
        of this layout, else dense (the base itself, refilled). `checked`: the values passed check_finite."""
        device = _device_of(items)
        if delta and self.version is not None and self.base is not None and self.base.fits(manifest, device):
            plan, buffers = encode(manifest, items, self.base, self.version, checked)
            return Wire(buffers, None if plan.all_dense else plan)  # (all changed: a dense push after all)
        self.version = None
        self.base = reuse_or_allocate(self.base, manifest, device)
        self.base.fill(items)
        return Wire(self.base.buffers)

    def commit(self, wire: Wire, version: int, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Every worker took `wire`, the push of `items`: the base becomes `version`. Buckets sent dense are
        adopted; the others are refilled from `items` (a delta decodes to exactly their cast, and a cast copy on
        the base's device is cheaper than decoding the wire again)."""
        base, plan = self.base, wire.plan
        self.version = None
        if plan is None:
            base.buffers = list(wire.buffers)
        else:
            sparse = {b for b, code in enumerate(plan.buckets) if code.sparse is not None}
            for b, code in enumerate(plan.buckets):
                if code.sparse is None:
                    base.buffers[b] = wire.buffers[b]
            base.fill([item for item, e in zip(items, base.manifest.entries) if e.bucket in sparse])
        self.version = version

    def full(self, version: int) -> Buckets | None:
        """The base when it holds `version` in full (what a restarted worker needs), else None."""
        return self.base if self.version == version and self.version is not None else None

    def release(self) -> None:
        self.base, self.version = None, None


def _device_of(items: Sequence[tuple[str, torch.Tensor]]) -> torch.device:
    """Where the base lives: the tensors' device when they share one, else host memory."""
    devices = {t.device for _, t in items}
    return devices.pop() if len(devices) == 1 else torch.device("cpu")
