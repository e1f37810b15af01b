"""The torch reference Ops: plain torch on any device. They define the semantics; the CPU's Ops (ops/cpu_ops.py)
and the CUDA Ops subclass this class and override what they have kernels for."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rollout_service.ops import attention, fp8, moe_experts, norm, rope, sampling


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class TorchOps:
    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return norm.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return norm.add_rms_norm(x, residual, weight, eps)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T (+ bias), float32 accumulation rounded once to the dtype (as cuBLAS does)."""
        return F.linear(x, weight, bias)

    def gated_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """silu_and_mul of the fused gate_up projection: weight [2I, H] holds the gate rows, then the up rows."""
        return self.silu_and_mul(self.linear(x, weight, bias))

    def fp8_linear(self, x: torch.Tensor | fp8.Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T (+ bias) with an e4m3 weight and per-output-channel scales; x quantized per token unless
        it already is (ops/fp8.py)."""
        return fp8.linear(x, weight, weight_scale, bias)

    def fp8_quantize(self, x: torch.Tensor) -> fp8.Fp8Rows:
        """x [T, K] quantized per row for an FP8 product."""
        return fp8.Fp8Rows.of(x)

    def rms_norm_fp8(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[fp8.Fp8Rows, torch.Tensor]:
        """(rms_norm quantized per row, the residual): add_rms_norm's when a residual is given, else x's norm
        with x as the residual. For an FP8 product's input: a kernel backend fuses the quantization."""
        if residual is None:
            return self.fp8_quantize(self.rms_norm(x, weight, eps)), x
        y, residual = self.add_rms_norm(x, residual, weight, eps)
        return self.fp8_quantize(y), residual

    def silu_and_mul_fp8(self, gate_up: torch.Tensor) -> fp8.Fp8Rows:
        """silu_and_mul quantized per row (the FP8 down projection's input)."""
        return self.fp8_quantize(self.silu_and_mul(gate_up))

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of a fused [T, 2I] gate_up projection (gate half first); silu rounds to the dtype."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def moe_route(self, x: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool,
                  record: torch.Tensor | None = None,
                  slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids int32 [T, k], weights float32 [T, k]) of x [T, H] under router weight [E, H] (ops/moe_experts.py);
        with a routing table `record` [num_slots, k], the ids are also written at the rows' KV `slots`."""
        ids, weights = moe_experts.route(x, weight, top_k, renormalize)
        moe_experts.record(record, slots, ids)
        return ids, weights

    def moe_graph_blocker(self, dtype: torch.dtype, device: torch.device) -> str | None:
        """Why a decode step with MoE layers cannot be captured in a CUDA graph with these ops (None: it can).
        Here moe_experts reads each expert's row count on the host (ops/moe_experts.py)."""
        return (f"the {self.name} ops' mixture-of-experts layers read the tokens per expert on the host, which a "
                "CUDA graph cannot capture")

    def moe_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
        """[T, H]: each token's k experts (stacked gate_up [E, 2I, H], down [E, H, I]) mixed by its weights
        (ops/moe_experts.py)."""
        return moe_experts.experts(x, ids, weights, gate_up, down)

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tables = self._per_step("rope", (positions, cos_sin), q.dtype,
                                lambda: rope.rope_tables(positions, cos_sin, q.dtype))
        return rope.rotate(q, tables), rope.rotate(k, tables)

    def write_kv(self, kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        rows = None
        if kv_layer.is_contiguous():
            rows = self._per_step("kv_rows", (slot_mapping,), kv_layer.shape,
                                  lambda: attention.kv_rows(kv_layer, slot_mapping))
        attention.write_kv(kv_layer, k, v, slot_mapping, rows)

    def _per_step(self, name: str, inputs: tuple[torch.Tensor, ...], extra, make):
        """What `make` derives from `inputs`, made once for the layers of a step: kept while the same tensor
        objects come back unmodified (their version counters unchanged; inference tensors have none) with the
        same `extra`. A step's
        metadata is new tensors each step, so this never outlives the step it was made for. Never kept across a
        CUDA graph capture: a graph must compute it itself, for every replay."""
        if _capturing(inputs[0]):
            return make()
        cache = self.__dict__.setdefault("_step_cache", {})
        key = tuple((id(t), -1 if t.is_inference() else t._version) for t in inputs) + (extra,)
        hit = cache.get(name)
        if hit is not None and hit[0] == key and all(a is b for a, b in zip(hit[1], inputs)):
            return hit[2]
        value = make()
        cache[name] = (key, inputs, value)  # holds the inputs: their ids cannot be reused meanwhile
        return value

    def rope_and_write_kv(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
        kv_layer: torch.Tensor, slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """rope(q, k), then write_kv(k, v); returns the rotated q. One fusable step for kernel backends."""
        q, k = self.rope(q, k, positions, cos_sin)
        self.write_kv(kv_layer, k, v, slot_mapping)
        return q

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """float32 hidden [T, H] @ weight [V, H].T, never rounded to the model dtype on the way: a bf16 logit of
        magnitude 10 is only resolved to 0.06, which would move every log-prob by up to 0.03. Half inputs
        multiply exactly in float32 and accumulate in float32 on every device (cuBLAS does it natively)."""
        if hidden.is_cuda and hidden.dim() == 2 and hidden.dtype == weight.dtype:
            return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
        return F.linear(hidden.float(), weight.float())

    def attention(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: attention.AttentionMetadata, scale: float
    ) -> torch.Tensor:
        return attention.paged_attention(q, kv_layer, meta, scale)

    def gumbel_argmax(self, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """int64 [B]: argmax over vocab ids v of x[b, v] + gumbel(keys[b], v), a draw from softmax(x[b])."""
        return sampling.gumbel_argmax(x, keys)

    def argmax_logsumexp(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens int64 [B], values [B], lse [B]) of rows x [B, V]: `values, tokens = x.max(dim=1)` (NaN the
        largest, the first index on ties, values[b] = x[b, tokens[b]]) and `lse = x.logsumexp(dim=1)` (NaN if
        the row has a NaN, else +inf if it has a +inf). Kernel backends read x once for all three."""
        values, tokens = x.max(dim=1)
        return tokens, values, self.logsumexp(x)

    def logsumexp(self, x: torch.Tensor) -> torch.Tensor:
        """[B] log-sum-exp of each row of x [B, V] (the sampler's normaliser)."""
        return x.logsumexp(dim=1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
